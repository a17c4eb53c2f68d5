//! Routing policies without a GPU (runs in CI): a receiver that asks for host landings or for
//! zero-copy only still takes host tensors from another process, `Sender::route` gives the host
//! route or a typed error where there is no GPU, and `ReceiverOptions` reach the sender intact
//! through `Receiver::bind_with` (the sender's `route` agrees with the pure `choose` on the
//! receiver's policy). The other process is `tq-cross produce --case host`.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::cross::{CrossItem, host_pattern_i32, views_of};
use integration_tests::{bin_path, socket_path};
use kernels::reference;
use tensor_queue::route::{Landing, PeerMode, Route, Routing, Strictness};
use tensor_queue::testing::{Reach, choose};
use tensor_queue::{DType, Error, Receiver, ReceiverOptions, Sender, Tensor, TransferPath, Uuid, is_gpu_available};

fn tq_cross() -> std::path::PathBuf {
    bin_path("tq-cross").expect("the tq-cross helper, built with these tests")
}

/// A made-up GPU that no machine has.
const NOWHERE: Uuid = Uuid([7; 16]);

/// Receives `count` messages of `tq-cross produce --case host` at a receiver with `routing`;
/// checks every tensor's bytes and path; returns what the producer printed.
fn host_messages_through(routing: Routing, count: u64) -> Result<String> {
    let path = socket_path("routes-host");
    let mut receiver = Receiver::<CrossItem>::builder().capacity(4).routing(routing).bind(&path)?;
    let child = Command::new(tq_cross())
        .args(["produce", "--case", "host", "--deadline-s", "60", "--count", &count.to_string(), "--to"])
        .arg(&path)
        .args(["--ask", &NOWHERE.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting tq-cross")?;
    let views = views_of(&host_pattern_i32(256, 1024, 0)?)?;
    for n in 0..count {
        let item = receiver.recv_timeout(Duration::from_secs(30)).with_context(|| format!("message {n}"))?;
        ensure!(item.id == n, "message {} arrived as number {n}", item.id);
        ensure!(item.tensors.len() == views.len(), "{} tensors", item.tensors.len());
        for (i, (t, (name, view))) in item.tensors.iter().zip(&views).enumerate() {
            ensure!(t.path() == TransferPath::HostSharedMemory, "{name}: arrived by {:?}", t.path());
            ensure!(t.shape() == view.shape(), "{name}: shape {:?}, expected {:?}", t.shape(), view.shape());
            let seen = reference::checksum(&t.to_bytes()?);
            ensure!(
                seen == item.checksums[i] && seen == item.reference[i],
                "{name}: checksum {seen:#x}, the producer's {:#x}, the reference {:#x}",
                item.checksums[i],
                item.reference[i]
            );
        }
    }
    let output = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    ensure!(output.status.success(), "tq-cross failed ({}): {text}", output.status);
    ensure!(text.contains("released") && text.contains("\ndone"), "the producer: {text}");
    Ok(text)
}

#[test]
fn a_host_landing_receiver_takes_host_tensors_from_another_process() -> Result<()> {
    host_messages_through(Routing::default().land(Landing::Host), 3)?;
    Ok(())
}

#[test]
fn a_zero_copy_receiver_takes_host_tensors_from_another_process() -> Result<()> {
    host_messages_through(Routing::default().strict(Strictness::ZeroCopy), 3)?;
    host_messages_through(Routing::default().land(Landing::Host).strict(Strictness::ZeroCopy), 2)?;
    host_messages_through(Routing::default().land(Landing::Host).strict(Strictness::NoStaging), 2)?;
    Ok(())
}

/// Whether `error` is one of the typed answers a route question may get.
fn typed_route_error(error: &Error) -> bool {
    matches!(error, Error::RouteRefused(_) | Error::Invalid(_))
}

#[test]
fn sender_route_without_a_gpu_is_host_or_a_typed_error() -> Result<()> {
    // Across processes: the host-only producer asks about a GPU it does not have.
    let text = host_messages_through(Routing::default(), 1)?;
    let line = text.lines().find(|l| l.starts_with("route")).context("the producer printed no route line")?;
    println!("the host-only producer's Sender::route: {line}");
    if !is_gpu_available() {
        ensure!(
            line.starts_with("route Host target host") || line.starts_with("route-error RouteRefused"),
            "without a GPU, Sender::route across processes said: {line}"
        );
    }
    ensure!(!line.contains("Timeout") && !line.contains("Disconnected"), "{line}");
    // In this process, for a default receiver and a zero-copy one.
    for (name, routing) in
        [("default", Routing::default()), ("zero-copy", Routing::default().strict(Strictness::ZeroCopy))]
    {
        let path = socket_path("route-question");
        let _receiver = Receiver::<u32>::builder().routing(routing).bind(&path)?;
        let sender = Sender::<u32>::connect(&path)?;
        match sender.route(&NOWHERE, Duration::from_secs(10)) {
            Ok(choice) => {
                if !is_gpu_available() {
                    ensure!(
                        choice.route == Route::Host && choice.target.is_none(),
                        "{name}: without a GPU the route is the host one: {choice:?}"
                    );
                }
                ensure!(
                    name != "zero-copy" || choice.route.is_zero_copy(),
                    "{name}: route said {choice:?}, a route the receiver's strictness refuses"
                );
            }
            Err(error) => ensure!(typed_route_error(&error), "{name}: not a typed answer: {error:?}"),
        }
    }
    Ok(())
}

/// Through the builder, and through the deprecated `bind_with` (which still works), in turn.
#[test]
#[allow(deprecated)]
fn receiver_options_round_trip_through_bind_with() -> Result<()> {
    let other = Uuid([9; 16]);
    let policies = [
        Routing::default(),
        Routing::default().land(Landing::Host),
        Routing::default().strict(Strictness::ZeroCopy),
        Routing::default().land(Landing::Host).strict(Strictness::ZeroCopy),
        Routing::default().land(Landing::Host).strict(Strictness::NoStaging),
        Routing::default().land(Landing::Device(other)).peer(PeerMode::Map),
        Routing::default().land(Landing::Device(other)).land_from(NOWHERE, Landing::Host),
        Routing::default().land_from(NOWHERE, Landing::Device(other)).strict(Strictness::NoStaging),
    ];
    for (n, routing) in policies.into_iter().enumerate() {
        let path = socket_path("options");
        let mut receiver = if n % 2 == 0 {
            Receiver::<Tensor>::builder().capacity(3).routing(routing.clone()).bind(&path)?
        } else {
            let mut options = ReceiverOptions::default();
            options.capacity = 3;
            options.routing = routing.clone();
            ensure!(options.clone() == options, "ReceiverOptions compare");
            Receiver::<Tensor>::bind_with(&path, options)?
        };
        let sender = Sender::<Tensor>::connect(&path)?;
        // The policy reached the sender: its answer is the pure decision on that policy (both
        // ends are this process, so both reaches are this machine's).
        let asked = sender.route(&NOWHERE, Duration::from_secs(10));
        let decided = choose(&NOWHERE, &routing, Reach::local(), Reach::local());
        match (&asked, &decided) {
            (Ok(a), Ok(d)) => ensure!(
                (a.route, a.target) == (d.route, d.target),
                "policy {n} {routing:?}: the sender said {a:?}, the policy decides {d:?}"
            ),
            (Err(Error::RouteRefused(a)), Err(d)) => {
                ensure!((a.route, a.strict) == (d.route, d.strict), "policy {n}: refused as {a:?}, decided {d:?}")
            }
            (Err(error), _) if typed_route_error(error) && decided.is_err() => {}
            _ => bail!("policy {n} {routing:?}: the sender said {asked:?}, the policy decides {decided:?}"),
        }
        // The capacity reached it too: three messages fit, a fourth does not.
        sender.wait_ready(Duration::from_secs(10))?;
        for i in 0..3u8 {
            sender.try_send(&Tensor::from_slice(&[i; 8], DType::U8, &[8])?)?;
        }
        let fourth = sender.try_send(&Tensor::zeros(DType::U8, &[8])?);
        ensure!(matches!(fourth, Err(Error::Full)), "policy {n}: a fourth message with capacity 3: {fourth:?}");
        for i in 0..3u8 {
            let t = receiver.recv_timeout(Duration::from_secs(10))?;
            ensure!(
                t.to_vec::<u8>()? == [i; 8] && t.path() == TransferPath::HostSharedMemory,
                "policy {n}: message {i}"
            );
        }
    }
    Ok(())
}
