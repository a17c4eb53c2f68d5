//! Cross-device routes with real processes (issue 11): a producer on one GPU, a consumer whose
//! tensors land on another (or in host memory), each in a process of its own (`tq-cross`,
//! `tests/src/bin/tq-cross.rs`). Every byte is checked by a checksum the consumer computes on
//! the GPU, against the producer's own GPU checksum and the CPU's reference sent in the message.
//! GPUs are matched by UUID, never by ordinal.
//!
//! Tests that need two GPUs report `ignored (needs 2 GPUs: found N)` elsewhere; those that need
//! one (the host landing, the strict policies with a host landing) run with one. Every wait has
//! a deadline and every helper is killed when its test ends, pass or fail. Tests run one at a
//! time unless `--test-threads` says otherwise (they measure free device memory).

use std::io::Write as _;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::cross::{MsgReport, host_pattern_i32, views_of};
use integration_tests::{bin_path, gpu_skip_reason, socket_path};
use tensor_queue::Uuid;
use tensor_queue::route::Route;

/// A test and the GPUs it needs.
struct CrossTest {
    name: &'static str,
    gpus: usize,
    run: fn(&Gpus) -> Result<()>,
}

fn main() {
    use libtest_mimic::{Arguments, Completion, Failed, Trial};
    let tests = vec![
        CrossTest { name: "peer_copy_lands_on_the_other_gpu", gpus: 2, run: peer_copy },
        CrossTest { name: "peer_map_maps_the_senders_memory_for_the_other_gpu", gpus: 2, run: peer_map },
        CrossTest { name: "staged_when_neither_process_sees_both_gpus", gpus: 2, run: staged },
        CrossTest { name: "host_landing_delivers_gpu_tensors_as_host_tensors", gpus: 1, run: host_landing },
        CrossTest { name: "seed_matmuls_ordered_over_peer_copy", gpus: 2, run: seed_peer_copy },
        CrossTest { name: "seed_matmuls_ordered_over_peer_map", gpus: 2, run: seed_peer_map },
        CrossTest { name: "seed_matmuls_ordered_over_staged", gpus: 2, run: seed_staged },
        CrossTest { name: "seed_matmuls_ordered_into_host_memory", gpus: 1, run: seed_host },
        CrossTest { name: "seed_without_ordering_fails_over_peer_copy", gpus: 2, run: seed_unordered_peer_copy },
        CrossTest { name: "seed_without_ordering_fails_over_peer_map", gpus: 2, run: seed_unordered_peer_map },
        CrossTest { name: "seed_without_ordering_fails_over_staged", gpus: 2, run: seed_unordered_staged },
        CrossTest { name: "sender_killed_mid_staged_1gib_transfer", gpus: 2, run: killed_mid_staged },
        CrossTest { name: "sender_killed_before_its_peer_copy_ran", gpus: 2, run: killed_mid_peer_copy },
        CrossTest { name: "sender_killed_before_its_peer_mapped_tensor_was_done", gpus: 2, run: killed_mid_peer_map },
        CrossTest { name: "differing_visible_devices_land_by_uuid", gpus: 2, run: differing_visible_devices },
        CrossTest { name: "zero_copy_receiver_refuses_peer_copy", gpus: 2, run: zero_copy_refuses_peer_copy },
        CrossTest { name: "no_staging_receiver_refuses_staged", gpus: 2, run: no_staging_refuses_staged },
        CrossTest { name: "strict_policies_with_a_host_landing", gpus: 1, run: strict_with_host_landing },
        CrossTest { name: "several_senders_and_a_forwarding_stage", gpus: 2, run: forwarding_stage },
        CrossTest { name: "one_message_broadcast_over_every_route_of_the_machine", gpus: 2, run: broadcast_routes },
        CrossTest { name: "across_hosts_nccl_lands_on_the_receivers_gpu", gpus: 2, run: nccl_default },
        CrossTest { name: "across_hosts_nccl_forced_onto_its_network_transport", gpus: 2, run: nccl_network },
        CrossTest { name: "across_hosts_host_landing_over_tcp", gpus: 1, run: tcp_host_landing },
        CrossTest { name: "across_hosts_seed_matmuls_ordered_over_nccl", gpus: 2, run: seed_nccl },
        CrossTest { name: "across_hosts_seed_without_ordering_fails_over_nccl", gpus: 2, run: seed_unordered_nccl },
        CrossTest { name: "across_hosts_sender_killed_mid_nccl_transfer", gpus: 2, run: killed_sender_nccl },
        CrossTest { name: "across_hosts_receiver_killed_mid_nccl_transfer", gpus: 2, run: killed_receiver_nccl },
        CrossTest { name: "across_hosts_ten_thousand_messages_leak_nothing", gpus: 2, run: many_nccl },
        CrossTest { name: "across_hosts_both_ways_then_a_clean_exit", gpus: 2, run: both_ways_clean_exit },
        CrossTest { name: "across_hosts_broadcast_to_two_receivers", gpus: 2, run: broadcast_nccl },
        CrossTest {
            name: "across_hosts_nccl_and_host_senders_share_one_receiver",
            gpus: 2,
            run: nccl_beside_host_senders,
        },
        CrossTest { name: "small_messages_inline_without_nccl_onto_the_receivers_gpu", gpus: 2, run: inline_sizes },
        CrossTest { name: "small_messages_inline_up_to_the_threshold_and_nccl_above", gpus: 2, run: inline_threshold },
        CrossTest { name: "small_messages_inline_a_mixed_message", gpus: 2, run: inline_mixed },
        CrossTest { name: "small_messages_inline_sender_killed_right_after_send", gpus: 2, run: inline_killed_sender },
        CrossTest { name: "small_messages_inline_from_many_senders_leak_nothing", gpus: 2, run: inline_many_senders },
    ];
    let found = gpus_here();
    static SKIPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let trials = tests
        .into_iter()
        .map(|CrossTest { name, gpus, run }| {
            let found = found.clone();
            Trial::ignorable_test(name, move || match found {
                Ok(ref g) if g.uuids.len() >= gpus => {
                    eprintln!("[starting {name}]");
                    run(g).map(|()| Completion::Completed).map_err(|e| Failed::from(format!("{e:#}")))
                }
                Ok(ref g) => Ok(Completion::ignored_with(format!(
                    "needs {gpus} GPU{}: found {}",
                    if gpus == 1 { "" } else { "s" },
                    g.uuids.len()
                ))),
                // The reason, the same for every test, is said once at the end.
                Err(_) => {
                    SKIPPED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok(Completion::ignored_with("no GPU"))
                }
            })
        })
        .collect();
    let mut args = Arguments::from_args();
    // They measure free device memory and start processes on both GPUs: one at a time.
    args.test_threads.get_or_insert(1);
    let conclusion = libtest_mimic::run(&args, trials);
    if let Err(why) = &found {
        integration_tests::note_gpu_skips(SKIPPED.load(std::sync::atomic::Ordering::Relaxed), why);
    }
    conclusion.exit()
}

/// The GPUs this test process sees (by UUID, in its ordinal order), and how to make a child see
/// some of them.
#[derive(Clone)]
struct Gpus {
    uuids: Vec<Uuid>,
    /// Whether this process runs under `CUDA_VISIBLE_DEVICES` (then children are given UUIDs,
    /// which mean the same GPUs whatever the list).
    restricted: bool,
}

impl Gpus {
    /// GPU `i` of this process.
    fn uuid(&self, i: usize) -> Uuid {
        self.uuids[i]
    }

    /// The `CUDA_VISIBLE_DEVICES` value for a child that sees this process's GPUs `ordinals`, in
    /// that order: plain ordinals (`1,0`), or their UUIDs where this process is restricted.
    fn visible(&self, ordinals: &[usize]) -> String {
        let names: Vec<String> =
            ordinals.iter().map(|&i| if self.restricted { self.uuids[i].to_string() } else { i.to_string() }).collect();
        names.join(",")
    }
}

fn gpus_here() -> std::result::Result<Gpus, String> {
    if let Some(reason) = gpu_skip_reason() {
        return Err(reason);
    }
    let count = tensor_queue::Device::count().map_err(|e| format!("no GPU here: {e}"))?;
    let uuids = (0..count)
        .map(|i| tensor_queue::Device::get(i).and_then(|d| d.uuid()))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| format!("GPU UUIDs: {e}"))?;
    Ok(Gpus { uuids, restricted: std::env::var_os("CUDA_VISIBLE_DEVICES").is_some() })
}

/// The `tq-cross` binary: next to the tests, or where the GPU bundle says (cargo's build path
/// does not exist in the bundle).
fn tq_cross() -> std::path::PathBuf {
    bin_path("tq-cross").expect("the tq-cross helper, built with these tests")
}

// ---------------------------------------------------------------- processes

/// A running `tq-cross`: its stdout lines, its stdin, and a SIGKILL when it goes out of scope.
struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    said: Vec<String>,
    /// Lines before this index were matched by `expect` already.
    cursor: usize,
    stdin: Option<ChildStdin>,
}

impl Proc {
    /// Starts `tq-cross <args>` with `CUDA_VISIBLE_DEVICES=visible` (inherited when `None`) and
    /// the extra environment `env`.
    fn start(name: &str, args: &[String], visible: Option<&str>, env: &[(&str, &str)]) -> Result<Proc> {
        let mut command = Command::new(tq_cross());
        command.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        if let Some(visible) = visible {
            command.env("CUDA_VISIBLE_DEVICES", visible);
        }
        command.env("TQ_SECRET", TEST_SECRET).envs(env.iter().copied());
        let mut child = command.spawn().with_context(|| format!("starting tq-cross for {name}"))?;
        let lines = integration_tests::stdout_lines(&mut child, None);
        let stdin = child.stdin.take();
        let name = format!("{name} (pid {}, CUDA_VISIBLE_DEVICES={})", child.id(), visible.unwrap_or("inherited"));
        Ok(Proc { name, child, lines, said: Vec::new(), cursor: 0, stdin })
    }

    /// The next line (after the last one matched) starting with `prefix`, within `timeout`. A
    /// line starting with `error` fails at once.
    fn expect(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            while self.cursor < self.said.len() {
                let line = self.said[self.cursor].clone();
                self.cursor += 1;
                if line.starts_with(prefix) {
                    return Ok(line);
                }
                if line.starts_with("error") {
                    bail!("{} failed while we waited for {prefix:?}: {line}\n{}", self.name, self.tail(30));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    eprintln!("  [{}] {}", self.name.split(' ').next().unwrap_or(""), short(&line));
                    self.said.push(line);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    bail!("{} did not say {prefix:?} within {timeout:?}\n{}", self.name, self.tail(30))
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.try_wait().ok().flatten();
                    bail!("{} ended ({status:?}) before saying {prefix:?}\n{}", self.name, self.tail(30))
                }
            }
        }
    }

    /// The text after `prefix` of the next line starting with it.
    fn value(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        Ok(self.expect(prefix, timeout)?[prefix.len()..].trim().to_string())
    }

    /// The next `report` line, parsed.
    fn report(&mut self, timeout: Duration) -> Result<MsgReport> {
        let line = self.value("report ", timeout)?;
        serde_json::from_str(&line).with_context(|| format!("a report line: {line}"))
    }

    /// Takes in what it said so far, without waiting.
    fn poll(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.said.push(line);
        }
    }

    /// Whether any line said so far (matched or not) starts with `prefix`.
    fn has_said(&mut self, prefix: &str) -> bool {
        self.poll();
        self.said.iter().any(|l| l.starts_with(prefix))
    }

    fn say(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("stdin already closed")?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    /// Closes stdin and waits (bounded) for it to exit successfully.
    fn finish(&mut self, timeout: Duration) -> Result<()> {
        self.stdin = None;
        let status = self.wait(timeout)?;
        self.poll();
        ensure!(status.success(), "{} exited with {status}\n{}", self.name, self.tail(30));
        Ok(())
    }

    fn wait(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                bail!("{} did not exit within {timeout:?}\n{}", self.name, self.tail(30));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill(&mut self) -> Result<()> {
        self.child.kill()?; // SIGKILL
        self.wait(Duration::from_secs(10))?;
        Ok(())
    }

    fn tail(&self, n: usize) -> String {
        let start = self.said.len().saturating_sub(n);
        format!("{} said {} lines, the last: {:#?}", self.name, self.said.len(), &self.said[start..])
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A line shortened for the log.
fn short(line: &str) -> String {
    if line.chars().count() > 300 {
        format!("{}...", line.chars().take(300).collect::<String>())
    } else {
        line.to_string()
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// The secret every helper is given (`TQ_SECRET`), for the channels over TCP.
const TEST_SECRET: &str = "the cross-device tests' shared secret";

/// An option of these tests, not of `tq-cross`: the consumer listens on TCP (127.0.0.1 and a
/// free port), so its producers count as on another host.
const OVER_TCP: &str = "--over-tcp";

/// Starts a consumer listening at a fresh path (or, with [`OVER_TCP`] among `options`, a TCP
/// endpoint) with `options` (see `tq-cross consume`); returns it and the endpoint once it is
/// ready.
fn consumer(
    name: &str,
    options: &[String],
    visible: Option<&str>,
    env: &[(&str, &str)],
) -> Result<(Proc, std::path::PathBuf)> {
    let path = if options.iter().any(|o| o == OVER_TCP) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        std::path::PathBuf::from(format!("tcp://127.0.0.1:{port}"))
    } else {
        socket_path(name)
    };
    let mut args = strings(&["consume", "--listen"]);
    args.push(path.display().to_string());
    args.extend(options.iter().filter(|o| *o != OVER_TCP).cloned());
    let mut proc = Proc::start(name, &args, visible, env)?;
    proc.expect("ready", Duration::from_secs(60))?;
    Ok((proc, path))
}

/// Starts a producer of `case` to `to` with `options`.
fn producer(
    name: &str,
    case: &str,
    to: &std::path::Path,
    options: &[String],
    visible: Option<&str>,
    env: &[(&str, &str)],
) -> Result<Proc> {
    let mut args = strings(&["produce", "--case", case, "--to"]);
    args.push(to.display().to_string());
    args.extend(options.iter().cloned());
    Proc::start(name, &args, visible, env)
}

/// `--gpu <uuid>`.
fn on_gpu(uuid: Uuid) -> Vec<String> {
    vec!["--gpu".into(), uuid.to_string()]
}

/// A producer's `route` line, parsed: `(route, target)`; fails on `route-error`.
fn route_line(producer: &mut Proc) -> Result<(String, String)> {
    let line = producer.expect("route", Duration::from_secs(60))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    ensure!(words.first() == Some(&"route") && words.len() >= 4, "{}: {line}", producer.name);
    Ok((words[1].to_string(), words[3].to_string()))
}

/// What every tensor of a message must show at the consumer.
struct Expect<'a> {
    path: &'a str,
    /// Where the bytes are (`host` or a UUID).
    device: String,
    /// The GPU its stream is on (`none` for host tensors).
    stream_device: String,
}

fn check_report(report: &MsgReport, expect: &Expect<'_>, what: &str) -> Result<()> {
    ensure!(!report.paths.is_empty(), "{what}: a message without tensors: {report:?}");
    ensure!(
        report.ok && !report.producer_failed,
        "{what}: the data differ: seen {:?}, producer {:?}, reference {:?} ({})",
        report.seen,
        report.producer,
        report.reference,
        report.note
    );
    ensure!(
        report.paths.iter().all(|p| p == expect.path),
        "{what}: paths {:?}, expected all {}",
        dedup(&report.paths),
        expect.path
    );
    ensure!(
        report.devices.iter().all(|d| *d == expect.device),
        "{what}: tensors on {:?}, expected all on {}",
        dedup(&report.devices),
        expect.device
    );
    ensure!(
        report.stream_devices.iter().all(|d| *d == expect.stream_device),
        "{what}: streams on {:?}, expected all on {}",
        dedup(&report.stream_devices),
        expect.stream_device
    );
    Ok(())
}

fn dedup(values: &[String]) -> Vec<String> {
    let mut v = values.to_vec();
    v.sort();
    v.dedup();
    v
}

/// Runs the three route cases (strided views, 1,024 small tensors, sizes up to 256 MiB) from
/// producers on GPU `source` (seeing `producer_visible`) to `consumer`, and checks each
/// message's paths and bytes, and that `Sender::route` said `route` and `target` beforehand.
fn route_cases(
    consumer: &mut Proc,
    path: &std::path::Path,
    source: Uuid,
    producer_visible: Option<&str>,
    route: Route,
    target: &str,
    expect: &Expect<'_>,
) -> Result<()> {
    route_cases_with(consumer, path, source, producer_visible, route, target, expect, &[])
}

/// [`route_cases`] with producers run in the extra environment `env`.
#[allow(clippy::too_many_arguments)]
fn route_cases_with(
    consumer: &mut Proc,
    path: &std::path::Path,
    source: Uuid,
    producer_visible: Option<&str>,
    route: Route,
    target: &str,
    expect: &Expect<'_>,
    env: &[(&str, &str)],
) -> Result<()> {
    let host_views = views_of(&host_pattern_i32(256, 1024, 11)?)?;
    for case in ["views", "many", "sizes"] {
        let mut producer = producer(case, case, path, &on_gpu(source), producer_visible, env)?;
        let (said_route, said_target) = route_line(&mut producer)?;
        ensure!(
            said_route == format!("{route:?}") && said_target == target,
            "Sender::route said {said_route} to {said_target}, expected {route:?} to {target}"
        );
        let messages = if case == "sizes" { 5 } else { 1 };
        for _ in 0..messages {
            let report = consumer.report(Duration::from_secs(120))?;
            check_report(&report, expect, &format!("{case} message {} ({})", report.id, report.note))?;
            if case == "views" {
                ensure!(report.paths.len() == host_views.len(), "{} tensors arrived", report.paths.len());
                for ((name, view), layout) in host_views.iter().zip(&report.layouts) {
                    let shape = format!("{:?}/", view.shape());
                    ensure!(layout.starts_with(&shape), "view {name} arrived as {layout}, shape {shape} expected");
                }
            }
            if case == "many" {
                ensure!(report.paths.len() == 1024, "{} of 1024 tensors arrived", report.paths.len());
            }
        }
        producer.expect("released", Duration::from_secs(60))?;
        producer.finish(Duration::from_secs(30))?;
    }
    Ok(())
}

// ---------------------------------------------------------------- 1. each route

fn peer_copy(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0), g.uuid(1));
    let (mut consumer, path) = consumer("peer-copy", &["--land".into(), gpu1.to_string()], None, &[])?;
    let expect = Expect { path: "PeerCopied", device: gpu1.to_string(), stream_device: gpu1.to_string() };
    route_cases(&mut consumer, &path, gpu0, None, Route::PeerCopy, &gpu1.to_string(), &expect)?;
    consumer.finish(Duration::from_secs(30))
}

fn peer_map(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0), g.uuid(1));
    let options = strings(&["--land", &gpu1.to_string(), "--peer", "map"]);
    let (mut consumer, path) = consumer("peer-map", &options, None, &[])?;
    // The bytes stay on the sender's GPU; the receiver's stream (its first use) is on GPU 1.
    let expect = Expect { path: "PeerMapped", device: gpu0.to_string(), stream_device: gpu1.to_string() };
    route_cases(&mut consumer, &path, gpu0, None, Route::PeerMap, &gpu1.to_string(), &expect)?;
    consumer.finish(Duration::from_secs(30))
}

fn staged(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0), g.uuid(1));
    // Neither process sees both GPUs: no link can be used, whatever the hardware has.
    let (mut consumer, path) = consumer("staged", &[], Some(&g.visible(&[1])), &[])?;
    let expect = Expect { path: "Staged", device: gpu1.to_string(), stream_device: gpu1.to_string() };
    route_cases(&mut consumer, &path, gpu0, Some(&g.visible(&[0])), Route::Staged, &gpu1.to_string(), &expect)?;
    consumer.finish(Duration::from_secs(30))
}

fn host_landing(g: &Gpus) -> Result<()> {
    let gpu0 = g.uuid(0);
    let (mut consumer, path) = consumer("host-landing", &strings(&["--land", "host"]), None, &[])?;
    let expect = Expect { path: "StagedToHost", device: "host".into(), stream_device: "none".into() };
    route_cases(&mut consumer, &path, gpu0, None, Route::Host, "host", &expect)?;
    consumer.finish(Duration::from_secs(30))
}

// ---------------------------------------------------------------- 2. the seed's ordering

/// The seed scenario from GPU 0 to a consumer set up by `options` and `consumer_visible`: the
/// consumer's checksum of `x` as it arrived, and whether it equals the producer's own after it
/// synchronised and the CPU's reference.
#[allow(clippy::too_many_arguments)]
fn seed_run(
    g: &Gpus,
    name: &str,
    options: &[String],
    consumer_visible: Option<&str>,
    producer_visible: Option<&str>,
    env: &[(&str, &str)],
    expect: &Expect<'_>,
    route: Route,
) -> Result<bool> {
    let (mut consumer, path) = consumer(name, options, consumer_visible, env)?;
    let mut seed_options = on_gpu(g.uuid(0));
    if route == Route::Nccl {
        seed_options.push("--warm-up".into()); // the communicator is set up before the race
    }
    let mut producer = producer(name, "seed", &path, &seed_options, producer_visible, env)?;
    let (said_route, _) = route_line(&mut producer)?;
    ensure!(said_route == format!("{route:?}"), "Sender::route said {said_route}, expected {route:?}");
    let report = consumer.report(Duration::from_secs(120))?;
    ensure!(report.paths.len() == 1, "one tensor: {report:?}");
    ensure!(report.paths[0] == expect.path, "x arrived by {}, expected {}", report.paths[0], expect.path);
    ensure!(report.devices[0] == expect.device, "x is on {}, expected {}", report.devices[0], expect.device);
    let early: u64 = producer.value("early ", Duration::from_secs(60))?.split(' ').next().unwrap_or("").parse()?;
    let fin = producer.value("final ", Duration::from_secs(120))?;
    let words: Vec<&str> = fin.split_whitespace().collect();
    let (last, reference): (u64, u64) = (words[0].parse()?, words[2].parse()?);
    ensure!(last == reference, "the producer's own x after synchronising is {last:#x}, the CPU's {reference:#x}");
    ensure!(
        early != last,
        "the race window is missing: an unordered read right after send_on already saw the final x, so \
         this run cannot tell ordering from luck (make the matmuls longer)"
    );
    let verdict = consumer.expect("verdict 0 ", Duration::from_secs(120))?;
    let matched = verdict.starts_with("verdict 0 match");
    ensure!(
        matched == (report.seen[0] == reference),
        "the consumer's verdict ({verdict}) disagrees with its own report ({:#x} vs {reference:#x})",
        report.seen[0]
    );
    producer.expect("released", Duration::from_secs(60))?;
    producer.finish(Duration::from_secs(30))?;
    consumer.finish(Duration::from_secs(30))?;
    println!("{name}: the consumer saw {:#x}; final {last:#x}; an unordered early read {early:#x}", report.seen[0]);
    Ok(matched)
}

const SKIP_ORDERING: (&str, &str) = ("TENSOR_QUEUE_TEST_SKIP_ORDERING", "1");

fn seed_peer_copy(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let expect = Expect { path: "PeerCopied", device: gpu1.clone(), stream_device: gpu1.clone() };
    let options = strings(&["--land", &gpu1]);
    let ok = seed_run(g, "seed-peer-copy", &options, None, None, &[], &expect, Route::PeerCopy)?;
    ensure!(ok, "over PeerCopy the consumer saw x before the 50 matmuls were done");
    Ok(())
}

/// Over PeerMap the consumer's GPU 1 stream waits on the producer's word on GPU 0 over the link
/// itself (no stream or event of GPU 0 in between): its GPU checksum of the mapped bytes must
/// still see x only after the 50 matmuls.
fn seed_peer_map(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0).to_string(), g.uuid(1).to_string());
    let expect = Expect { path: "PeerMapped", device: gpu0, stream_device: gpu1.clone() };
    let options = strings(&["--land", &gpu1, "--peer", "map"]);
    let ok = seed_run(g, "seed-peer-map", &options, None, None, &[], &expect, Route::PeerMap)?;
    ensure!(ok, "over PeerMap the consumer saw x before the 50 matmuls were done");
    Ok(())
}

fn seed_staged(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let expect = Expect { path: "Staged", device: gpu1.clone(), stream_device: gpu1 };
    let (cv, pv) = (g.visible(&[1]), g.visible(&[0]));
    let ok = seed_run(g, "seed-staged", &[], Some(&cv), Some(&pv), &[], &expect, Route::Staged)?;
    ensure!(ok, "over Staged the consumer saw x before the 50 matmuls were done");
    Ok(())
}

fn seed_host(g: &Gpus) -> Result<()> {
    let expect = Expect { path: "StagedToHost", device: "host".into(), stream_device: "none".into() };
    let ok = seed_run(g, "seed-host", &strings(&["--land", "host"]), None, None, &[], &expect, Route::Host)?;
    ensure!(ok, "with a host landing the consumer saw x before the 50 matmuls were done");
    Ok(())
}

/// The negative control over PeerCopy: with the receivers' stream wait switched off (the
/// `test-switches` feature, on in this crate), the consumer must see x unfinished.
fn seed_unordered_peer_copy(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let expect = Expect { path: "PeerCopied", device: gpu1.clone(), stream_device: gpu1.clone() };
    let options = strings(&["--land", &gpu1]);
    let ok = seed_run(g, "seed-unordered-copy", &options, None, None, &[SKIP_ORDERING], &expect, Route::PeerCopy)?;
    ensure!(
        !ok,
        "with TENSOR_QUEUE_TEST_SKIP_ORDERING=1 the consumer still saw the final x over PeerCopy: either the switch \
         does not reach the peer-copy wait, or the positive test proves nothing"
    );
    Ok(())
}

/// The negative control over PeerMap, as over PeerCopy: the consumer reads the producer's x in
/// place, before the matmuls are done.
fn seed_unordered_peer_map(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0).to_string(), g.uuid(1).to_string());
    let expect = Expect { path: "PeerMapped", device: gpu0, stream_device: gpu1.clone() };
    let options = strings(&["--land", &gpu1, "--peer", "map"]);
    let ok = seed_run(g, "seed-unordered-map", &options, None, None, &[SKIP_ORDERING], &expect, Route::PeerMap)?;
    ensure!(
        !ok,
        "with TENSOR_QUEUE_TEST_SKIP_ORDERING=1 the consumer still saw the final x over PeerMap: either the switch \
         does not reach the peer-map wait, or the positive test proves nothing"
    );
    Ok(())
}

/// The negative control over Staged, as over PeerCopy. If this fails while the positive test
/// passes and the race window exists (checked in `seed_run`), the switch does not reach the
/// staged route's waits: the staged ordering is then unproven by a control.
fn seed_unordered_staged(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let expect = Expect { path: "Staged", device: gpu1.clone(), stream_device: gpu1 };
    let (cv, pv) = (g.visible(&[1]), g.visible(&[0]));
    let ok = seed_run(g, "seed-unordered-staged", &[], Some(&cv), Some(&pv), &[SKIP_ORDERING], &expect, Route::Staged)?;
    ensure!(
        !ok,
        "with TENSOR_QUEUE_TEST_SKIP_ORDERING=1 the consumer still saw the final x over Staged: the switch does not \
         reach the staged route's piece waits (the early-read control above shows the race window exists)"
    );
    Ok(())
}

// ---------------------------------------------------------------- 3. a sender killed mid-transfer

/// What `consumer` said of the message of a producer killed at `killed_at`, within 30 s: a
/// `producer-failed` line, or a report whose bytes, if it claims the message whole, are the
/// producer's; with `nothing_after`, also silence for that long ("nothing arrived"). Fails on a
/// stuck or failing receiver.
fn killed_producer_outcome(consumer: &mut Proc, killed_at: Instant, nothing_after: Option<Duration>) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        consumer.poll();
        if let Some(line) = consumer.said.iter().find(|l| l.starts_with("producer-failed ")) {
            return Ok(line.clone());
        }
        if let Some(line) = consumer.said.iter().find(|l| l.starts_with("report ")) {
            let report: MsgReport = serde_json::from_str(&line["report ".len()..])?;
            // The driver may still run a killed process's queued work while it tears the
            // context down (seen once in three runs on an H200): then the message is whole, and
            // must be reported so only if its bytes are the producer's, checked on the GPU.
            ensure!(
                report.producer_failed || (report.ok && report.seen == report.reference),
                "a message of a killed producer was delivered as complete, with other bytes: {report:?}"
            );
            return Ok(line.clone());
        }
        if let Some(line) = consumer.said.iter().find(|l| l.starts_with("stuck ") || l.starts_with("error")) {
            bail!("the receiver: {line}\n{}", consumer.tail(20));
        }
        if nothing_after.is_some_and(|quiet| killed_at.elapsed() > quiet) {
            return Ok("nothing arrived".to_string());
        }
        ensure!(Instant::now() < deadline, "no word of the killed producer within 30 s\n{}", consumer.tail(20));
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn killed_mid_staged(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let (cv, pv) = (g.visible(&[1]), g.visible(&[0]));
    let (mut consumer, path) = consumer("killed-staged", &[], Some(&cv), &[])?;
    let options = [on_gpu(g.uuid(0)), strings(&["--len", &(1u64 << 30).to_string(), "--spin-ms", "4000"])].concat();
    let mut doomed = producer("doomed", "spin-big", &path, &options, Some(&pv), &[])?;
    let (said_route, _) = route_line(&mut doomed)?;
    ensure!(said_route == "Staged", "Sender::route said {said_route}");
    doomed.expect("sent 0 0", Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_millis(500)); // the fill still spins; the staging is queued after it
    let killed_at = Instant::now();
    doomed.kill()?;
    // The receiver must say, within a bound, that this message is lost: no hang, no wrong data.
    let outcome = killed_producer_outcome(&mut consumer, killed_at, None)?;
    println!("the receiver reported the message {:?} after the kill: {}", killed_at.elapsed(), short(&outcome));
    let expect = Expect { path: "Staged", device: gpu1.clone(), stream_device: gpu1 };
    recovers(&mut consumer, &path, g, Some(&pv), &expect)?;
    consumer.say("mem")?;
    let mem = consumer.expect("mem ", Duration::from_secs(30))?;
    ensure!(mem.starts_with("mem ok"), "after the next sender: {mem}");
    consumer.finish(Duration::from_secs(30))
}

/// A producer killed while the fill of its 1 GiB tensor still spins, the message sent with
/// `send_on` to a receiver landing on GPU 1 by `route`: the receiver must say within a bound that
/// the message is lost (or, if the driver ran the queued work anyway, deliver the right bytes),
/// never hang on the word the dead producer's stream was to write, and then serve the next
/// sender with its memory back at its baseline.
fn killed_before_peer_route(g: &Gpus, name: &str, options: &[String], route: Route, expect: &Expect<'_>) -> Result<()> {
    let (mut consumer, path) = consumer(name, options, None, &[])?;
    let options = [on_gpu(g.uuid(0)), strings(&["--len", &(1u64 << 30).to_string(), "--spin-ms", "4000"])].concat();
    let mut doomed = producer("doomed", "spin-big", &path, &options, None, &[])?;
    let (said_route, _) = route_line(&mut doomed)?;
    ensure!(said_route == format!("{route:?}"), "Sender::route said {said_route}, expected {route:?}");
    doomed.expect("sent 0 0", Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_millis(500)); // the fill still spins; the copy or signal comes after it
    let killed_at = Instant::now();
    doomed.kill()?;
    let outcome = killed_producer_outcome(&mut consumer, killed_at, None)?;
    println!("{name}: the receiver reported the message {:?} after the kill: {}", killed_at.elapsed(), short(&outcome));
    recovers(&mut consumer, &path, g, None, expect)?;
    consumer.finish(Duration::from_secs(30))
}

/// Over PeerCopy the receiver waits on a word of GPU 1 that the producer's own stream writes
/// after the copy: the killed producer never writes it, the receiver's rescue does.
fn killed_mid_peer_copy(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let expect = Expect { path: "PeerCopied", device: gpu1.clone(), stream_device: gpu1.clone() };
    killed_before_peer_route(g, "killed-peer-copy", &strings(&["--land", &gpu1]), Route::PeerCopy, &expect)
}

/// Over PeerMap the receiver's GPU 1 stream waits on the producer's word on GPU 0 over the link.
fn killed_mid_peer_map(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0).to_string(), g.uuid(1).to_string());
    let expect = Expect { path: "PeerMapped", device: gpu0, stream_device: gpu1.clone() };
    let options = strings(&["--land", &gpu1, "--peer", "map"]);
    killed_before_peer_route(g, "killed-peer-map", &options, Route::PeerMap, &expect)
}

// ---------------------------------------------------------------- 4. differing visible devices

fn differing_visible_devices(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0), g.uuid(1));
    // What comes from GPU 0 lands on GPU 1 and the other way round, named by UUID only.
    let options = strings(&["--land-from", &format!("{gpu0}={gpu1}"), "--land-from", &format!("{gpu1}={gpu0}")]);
    let (mut consumer, path) = consumer("differing", &options, Some(&g.visible(&[0, 1])), &[])?;
    for (source, target) in [(gpu0, gpu1), (gpu1, gpu0)] {
        // The producer sees the GPUs in the other order: its ordinal 0 is our GPU 1.
        let mut producer = producer("differing", "views", &path, &on_gpu(source), Some(&g.visible(&[1, 0])), &[])?;
        producer.expect(&format!("gpu {source}"), Duration::from_secs(60))?;
        let (said_route, said_target) = route_line(&mut producer)?;
        ensure!(
            said_route == "PeerCopy" && said_target == target.to_string(),
            "from {source}: Sender::route said {said_route} to {said_target}, expected PeerCopy to {target}"
        );
        let report = consumer.report(Duration::from_secs(60))?;
        let expect = Expect { path: "PeerCopied", device: target.to_string(), stream_device: target.to_string() };
        check_report(&report, &expect, &format!("from {source}"))?;
        producer.expect("released", Duration::from_secs(60))?;
        producer.finish(Duration::from_secs(30))?;
    }
    consumer.finish(Duration::from_secs(30))
}

// ---------------------------------------------------------------- 5. strict policies

/// A producer of the `refused` case: `send_on` of a GPU tensor must be refused naming `route`
/// and `strict`, `Sender::route` must have said so beforehand, the connection must stay up, and
/// the host message after it must arrive intact.
fn expect_refusal(
    consumer: &mut Proc,
    path: &std::path::Path,
    source: Uuid,
    producer_visible: Option<&str>,
    route: Route,
    strict: &str,
) -> Result<()> {
    let mut producer = producer("refused", "refused", path, &on_gpu(source), producer_visible, &[])?;
    let said = producer.expect("route", Duration::from_secs(60))?;
    ensure!(
        said.starts_with(&format!("route-error RouteRefused {route:?} {strict}")),
        "Sender::route should have said the route is refused: {said}"
    );
    let outcome = producer.value("outcome ", Duration::from_secs(60))?;
    ensure!(outcome.starts_with(&format!("refused {route:?} {strict}")), "send_on: {outcome}");
    let text = producer.value("refused-text ", Duration::from_secs(10))?;
    ensure!(text.contains(&route.to_string()), "the error's text does not name the route ({route}): {text}");
    ensure!(producer.value("connected ", Duration::from_secs(10))? == "true", "a refusal closed the connection");
    let report = consumer.report(Duration::from_secs(60))?;
    ensure!(report.id == 1, "the refused message arrived after all: {report:?}");
    let expect = Expect { path: "HostSharedMemory", device: "host".into(), stream_device: "none".into() };
    check_report(&report, &expect, "the allowed message after a refusal")?;
    producer.expect("released", Duration::from_secs(60))?;
    producer.finish(Duration::from_secs(30))?;
    ensure!(!consumer.has_said("conn-error"), "the receiver closed a connection\n{}", consumer.tail(10));
    Ok(())
}

fn zero_copy_refuses_peer_copy(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let options = strings(&["--land", &gpu1, "--strict", "zero-copy"]);
    let (mut consumer, path) = consumer("zero-copy", &options, None, &[])?;
    expect_refusal(&mut consumer, &path, g.uuid(0), None, Route::PeerCopy, "ZeroCopy")?;
    // The same receiver takes a zero-copy route: a tensor already on GPU 1.
    let mut same = producer("same-gpu", "views", &path, &on_gpu(g.uuid(1)), None, &[])?;
    let (said_route, _) = route_line(&mut same)?;
    ensure!(said_route == "SameDevice", "from GPU 1 to a receiver landing on GPU 1: {said_route}");
    let report = consumer.report(Duration::from_secs(60))?;
    ensure!(report.paths.iter().all(|p| p == "CudaVmm" || p == "CudaLegacyIpc"), "{:?}", dedup(&report.paths));
    ensure!(report.ok, "{report:?}");
    same.expect("released", Duration::from_secs(60))?;
    same.finish(Duration::from_secs(30))?;
    consumer.finish(Duration::from_secs(30))
}

fn no_staging_refuses_staged(g: &Gpus) -> Result<()> {
    let (cv, pv) = (g.visible(&[1]), g.visible(&[0]));
    let (mut consumer, path) = consumer("no-staging", &strings(&["--strict", "no-staging"]), Some(&cv), &[])?;
    expect_refusal(&mut consumer, &path, g.uuid(0), Some(&pv), Route::Staged, "NoStaging")?;
    consumer.finish(Duration::from_secs(30))
}

/// One GPU: `ZeroCopy` with a host landing refuses GPU tensors (a host copy is no zero-copy
/// route); `NoStaging` with a host landing takes them (the docs allow what the receiver asked for).
fn strict_with_host_landing(g: &Gpus) -> Result<()> {
    let gpu0 = g.uuid(0);
    let (mut strict, path) =
        consumer("host-zero-copy", &strings(&["--land", "host", "--strict", "zero-copy"]), None, &[])?;
    expect_refusal(&mut strict, &path, gpu0, None, Route::Host, "ZeroCopy")?;
    strict.finish(Duration::from_secs(30))?;
    let (mut lenient, path) =
        consumer("host-no-staging", &strings(&["--land", "host", "--strict", "no-staging"]), None, &[])?;
    let mut producer = producer("host-no-staging", "views", &path, &on_gpu(gpu0), None, &[])?;
    let (said_route, said_target) = route_line(&mut producer)?;
    ensure!(said_route == "Host" && said_target == "host", "Sender::route said {said_route} to {said_target}");
    let report = lenient.report(Duration::from_secs(60))?;
    let expect = Expect { path: "StagedToHost", device: "host".into(), stream_device: "none".into() };
    check_report(&report, &expect, "NoStaging with a host landing")?;
    producer.expect("released", Duration::from_secs(60))?;
    producer.finish(Duration::from_secs(30))?;
    lenient.finish(Duration::from_secs(30))
}

// ---------------------------------------------------------------- 6. a forwarding stage

fn forwarding_stage(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0), g.uuid(1));
    const THREADS: u64 = 3;
    const PER_THREAD: u64 = 100;
    let total = THREADS * PER_THREAD;
    // The last stage: on GPU 0, holding all 300 messages before it drops any.
    let options = strings(&["--land", &gpu0.to_string(), "--hold", &total.to_string()]);
    let (mut last, last_path) = consumer("last", &options, None, &[])?;
    // The middle stage: receives on GPU 1 (PeerCopy from GPU 0), forwards copies over two senders.
    let middle_path = socket_path("middle");
    let mut args = strings(&["forward", "--listen", &middle_path.display().to_string()]);
    args.extend(strings(&["--to", &last_path.display().to_string(), "--land", &gpu1.to_string()]));
    args.extend(strings(&["--senders", "2", "--count", &total.to_string()]));
    let mut middle = Proc::start("middle", &args, None, &[])?;
    middle.expect("ready", Duration::from_secs(60))?;
    // The first stage: three senders in one process, each its own connection and stream.
    let options = [
        on_gpu(gpu0),
        strings(&["--threads", &THREADS.to_string(), "--count", &PER_THREAD.to_string(), "--len", "262144"]),
    ]
    .concat();
    let mut first = producer("first", "stream", &middle_path, &options, None, &[])?;
    let (said_route, said_target) = route_line(&mut first)?;
    ensure!(said_route == "PeerCopy" && said_target == gpu1.to_string(), "first stage: {said_route} to {said_target}");
    let mut ids = std::collections::HashSet::new();
    for n in 0..total {
        let report = last.report(Duration::from_secs(60)).with_context(|| format!("message {n} of {total}"))?;
        let expect = Expect { path: "PeerCopied", device: gpu0.to_string(), stream_device: gpu0.to_string() };
        check_report(&report, &expect, &format!("forwarded message {} ({})", report.id, report.note))?;
        ensure!(ids.insert(report.id), "message {} arrived twice", report.id);
    }
    last.expect(&format!("holding {total}"), Duration::from_secs(30))?;
    let paths = middle.value("stage-paths ", Duration::from_secs(10))?;
    ensure!(paths.contains("PeerCopied") && paths.contains(&gpu1.to_string()), "the middle stage got {paths}");
    ensure!(!middle.has_said("stage-mismatch"), "the middle stage saw wrong data\n{}", middle.tail(10));
    middle.expect("forwarded ", Duration::from_secs(30))?;
    middle.expect("done", Duration::from_secs(60))?;
    for _ in 0..THREADS {
        first.expect("released", Duration::from_secs(60))?;
    }
    first.expect("done", Duration::from_secs(30))?;
    first.finish(Duration::from_secs(30))?;
    middle.finish(Duration::from_secs(30))?;
    last.say("mem")?;
    let mem = last.expect("mem ", Duration::from_secs(30))?;
    ensure!(mem.starts_with("mem ok"), "the last stage's memory: {mem}");
    last.finish(Duration::from_secs(30))?;
    println!("{total} messages of 256 KiB from {THREADS} senders in one process through a forwarding stage");
    Ok(())
}

/// One message of GPU 0 views broadcast with `send_on` to four receivers at once, each by
/// another route: the same GPU and PeerMap (both wait for the message's one signal word, written
/// when the first of them needs it), PeerCopy (fenced by a word of its own on GPU 1, no message
/// word) and a host landing. Each checks every view by GPU (or CPU) checksum; every lease comes back.
fn broadcast_routes(g: &Gpus) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0).to_string(), g.uuid(1).to_string());
    let cases: [(&str, Vec<String>, Expect<'_>); 4] = [
        ("same-gpu", vec![], Expect { path: "CudaVmm", device: gpu0.clone(), stream_device: gpu0.clone() }),
        (
            "peer-map",
            strings(&["--land", &gpu1, "--peer", "map"]),
            Expect { path: "PeerMapped", device: gpu0.clone(), stream_device: gpu1.clone() },
        ),
        (
            "peer-copy",
            strings(&["--land", &gpu1]),
            Expect { path: "PeerCopied", device: gpu1.clone(), stream_device: gpu1.clone() },
        ),
        (
            "host",
            strings(&["--land", "host"]),
            Expect { path: "StagedToHost", device: "host".into(), stream_device: "none".into() },
        ),
    ];
    let mut receivers = Vec::new();
    for (name, options, expect) in cases {
        let (receiver, path) = consumer(&format!("broadcast-{name}"), &options, None, &[])?;
        receivers.push((receiver, path, expect));
    }
    let also: Vec<String> = receivers[1..].iter().map(|(_, path, _)| path.display().to_string()).collect();
    let options = [on_gpu(g.uuid(0)), strings(&["--also", &also.join(",")])].concat();
    let mut sender = producer("broadcaster", "views", &receivers[0].1, &options, None, &[])?;
    for (receiver, _, expect) in &mut receivers {
        let report = receiver.report(Duration::from_secs(120))?;
        check_report(&report, expect, &format!("{} ({})", receiver.name, report.note))?;
    }
    for _ in 0..receivers.len() {
        sender.expect("released", Duration::from_secs(60))?;
    }
    sender.finish(Duration::from_secs(30))?;
    for (mut receiver, _, _) in receivers {
        receiver.finish(Duration::from_secs(30))?;
    }
    Ok(())
}

// ---------------------------------------------------------------- 5. across hosts (TCP + NCCL)
//
// One process per GPU over 127.0.0.1: a TCP channel counts as across hosts whatever the
// addresses (tensors never travel as local handles over it), so no switch is needed. The
// producer works on GPU 0 and the consumer lands on GPU 1; both see both GPUs. (With each
// process restricted to its own GPU by CUDA_VISIBLE_DEVICES, NCCL 2.28.3 chose P2P/CUMEM and a
// second, larger transfer on a communicator hung on an H200 pair: see the closing note.)

/// NCCL's environment that forces its network transport between two processes of one host.
const NCCL_NET: [(&str, &str); 2] = [("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")];

/// The route cases over NCCL, to a consumer that reads each message late: the `many` case's
/// sender has dropped its tensors and filled fresh ones in their memory by then, so a transfer
/// that did not hold every tensor's memory delivers the fresh values.
fn nccl_cases(g: &Gpus, name: &str, env: &[(&str, &str)]) -> Result<()> {
    let (gpu0, gpu1) = (g.uuid(0), g.uuid(1));
    let mut options = over_tcp_onto(g);
    options.extend(strings(&["--late-ms", "200"]));
    let (mut consumer, path) = consumer(name, &options, None, env)?;
    let expect = Expect { path: "Nccl", device: gpu1.to_string(), stream_device: gpu1.to_string() };
    route_cases_with(&mut consumer, &path, gpu0, None, Route::Nccl, &gpu1.to_string(), &expect, env)?;
    consumer.finish(Duration::from_secs(30))
}

/// The consumer's options: TCP, landing on GPU 1.
fn over_tcp_onto(g: &Gpus) -> Vec<String> {
    strings(&[OVER_TCP, "--land", &g.uuid(1).to_string()])
}

/// The producers' environment that keeps every GPU tensor on NCCL, small messages too
/// (`TQ_INLINE_GPU_UP_TO=0`): the NCCL tests' messages of 1 B and 4095 B, warm-ups and 4 KiB
/// streams would otherwise travel inline (see the `small_messages_inline_*` tests).
const ALWAYS_NCCL: (&str, &str) = (tensor_queue::route::INLINE_GPU_ENV, "0");

fn nccl_default(g: &Gpus) -> Result<()> {
    nccl_cases(g, "nccl-default", &[ALWAYS_NCCL])
}

fn nccl_network(g: &Gpus) -> Result<()> {
    nccl_cases(g, "nccl-network", &[NCCL_NET[0], NCCL_NET[1], ALWAYS_NCCL])
}

/// Two NCCL senders (one process, a thread each) and a host-tensor sender stream into one
/// receiver at once. A message from another host waits, parked, while an NCCL worker queues its
/// receives, and `recv` decodes it meanwhile; a host message that comes in that time is
/// delivered first, and the early decode is dropped. Every message must arrive whole, each by
/// its own path.
fn nccl_beside_host_senders(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let (mut consumer, path) = consumer("nccl-beside-host", &over_tcp_onto(g), None, &[])?;
    let options = [on_gpu(g.uuid(0)), strings(&["--threads", "2", "--count", "100", "--len", "65536"])].concat();
    let mut nccl = producer("beside-nccl", "stream", &path, &options, None, &[ALWAYS_NCCL])?;
    let mut host = producer("beside-host", "host", &path, &strings(&["--count", "200"]), None, &[])?;
    for sender in [&mut nccl, &mut host] {
        sender.expect("done", Duration::from_secs(300))?;
        sender.finish(Duration::from_secs(30))?;
    }
    let nccl_expect = Expect { path: "Nccl", device: gpu1.clone(), stream_device: gpu1 };
    let host_expect = Expect { path: "Tcp", device: "host".into(), stream_device: "none".into() };
    let mut by_path = [0, 0];
    for n in 0..400 {
        let report = consumer.report(Duration::from_secs(60)).with_context(|| format!("report {n} of 400"))?;
        let (expect, count) = match report.paths.first().map(String::as_str) {
            Some("Nccl") => (&nccl_expect, &mut by_path[0]),
            _ => (&host_expect, &mut by_path[1]),
        };
        check_report(&report, expect, &format!("message {n} ({})", report.note))?;
        *count += 1;
    }
    ensure!(by_path == [200, 200], "{} NCCL and {} host messages of 200 each", by_path[0], by_path[1]);
    consumer.finish(Duration::from_secs(30))
}

fn tcp_host_landing(g: &Gpus) -> Result<()> {
    let gpu0 = g.uuid(0);
    let (mut consumer, path) = consumer("tcp-host", &strings(&[OVER_TCP, "--land", "host"]), None, &[])?;
    let expect = Expect { path: "Tcp", device: "host".into(), stream_device: "none".into() };
    route_cases(&mut consumer, &path, gpu0, None, Route::Tcp, "host", &expect)?;
    consumer.finish(Duration::from_secs(30))
}

fn seed_nccl(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let expect = Expect { path: "Nccl", device: gpu1.clone(), stream_device: gpu1 };
    let options = over_tcp_onto(g);
    let ok = seed_run(g, "seed-nccl", &options, None, None, &[ALWAYS_NCCL], &expect, Route::Nccl)?;
    ensure!(ok, "over NCCL the consumer saw x before the 50 matmuls were done");
    Ok(())
}

fn seed_unordered_nccl(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let expect = Expect { path: "Nccl", device: gpu1.clone(), stream_device: gpu1 };
    let options = over_tcp_onto(g);
    let env = [SKIP_ORDERING, ALWAYS_NCCL];
    let ok = seed_run(g, "seed-unordered-nccl", &options, None, None, &env, &expect, Route::Nccl)?;
    ensure!(!ok, "with TENSOR_QUEUE_TEST_SKIP_ORDERING=1 the consumer still saw the final x over NCCL");
    Ok(())
}

/// The receiver's memory back at its baseline, then another sender (seeing
/// `producer_visible`) received as usual, its tensors as `expect` says.
fn recovers(
    consumer: &mut Proc,
    path: &std::path::Path,
    g: &Gpus,
    producer_visible: Option<&str>,
    expect: &Expect<'_>,
) -> Result<()> {
    consumer.cursor = consumer.said.len();
    consumer.say("mem")?;
    let mem = consumer.expect("mem ", Duration::from_secs(30))?;
    ensure!(mem.starts_with("mem ok"), "the receiver's memory did not return to its baseline: {mem}");
    let mut next = producer("next", "views", path, &on_gpu(g.uuid(0)), producer_visible, &[])?;
    let report = consumer.report(Duration::from_secs(60))?;
    check_report(&report, expect, "the next sender's message")?;
    next.expect("released", Duration::from_secs(60))?;
    next.finish(Duration::from_secs(30))
}

fn killed_sender_nccl(g: &Gpus) -> Result<()> {
    let (mut consumer, path) = consumer("killed-sender-nccl", &over_tcp_onto(g), None, &[])?;
    // A first sender pays NCCL's one-time set-up in the receiver; the baseline is taken after it.
    let mut first = producer("first", "views", &path, &on_gpu(g.uuid(0)), None, &[])?;
    consumer.report(Duration::from_secs(60))?;
    first.expect("released", Duration::from_secs(60))?;
    first.finish(Duration::from_secs(30))?;
    std::thread::sleep(Duration::from_secs(2)); // its communicator is retired
    consumer.say("rebase")?;
    consumer.expect("rebased", Duration::from_secs(30))?;
    let options = [on_gpu(g.uuid(0)), strings(&["--len", &(1u64 << 30).to_string(), "--spin-ms", "3000"])].concat();
    let mut doomed = producer("doomed", "spin-big", &path, &options, None, &[])?;
    doomed.expect("sent 0 0", Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_millis(500)); // the fill spins; the NCCL send waits behind it
    let killed_at = Instant::now();
    doomed.kill()?;
    // A message never read (the sender died before its frame arrived) is no message at all.
    let outcome = killed_producer_outcome(&mut consumer, killed_at, Some(Duration::from_secs(10)))?;
    println!("the receiver after the kill ({:?}): {}", killed_at.elapsed(), short(&outcome));
    let gpu1 = g.uuid(1).to_string();
    recovers(&mut consumer, &path, g, None, &Expect { path: "Nccl", device: gpu1.clone(), stream_device: gpu1 })?;
    consumer.finish(Duration::from_secs(30))
}

fn killed_receiver_nccl(g: &Gpus) -> Result<()> {
    let (mut doomed, path) = consumer("doomed-receiver", &over_tcp_onto(g), None, &[])?;
    let options = [on_gpu(g.uuid(0)), strings(&["--count", "100000", "--len", &(64 << 20).to_string()])].concat();
    let mut sender = producer("sender", "stream", &path, &options, None, &[])?;
    sender.expect("sent 0 3", Duration::from_secs(60))?;
    let killed_at = Instant::now();
    doomed.kill()?;
    let line = sender.expect("error", Duration::from_secs(30))?;
    let took = killed_at.elapsed();
    ensure!(line.contains("disconnected") || line.contains("Disconnected"), "the sender's error: {line}");
    let status = sender.wait(Duration::from_secs(30))?;
    println!("the sender saw the receiver's death after {took:?}: {line} (exit {status})");
    Ok(())
}

/// One message broadcast to two receivers on "other hosts" (two processes, each with its own
/// communicator with the sender), each checking every view by GPU checksum.
fn broadcast_nccl(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let expect = Expect { path: "Nccl", device: gpu1.clone(), stream_device: gpu1 };
    let (mut first, first_path) = consumer("broadcast-a", &over_tcp_onto(g), None, &[])?;
    let (mut second, second_path) = consumer("broadcast-b", &over_tcp_onto(g), None, &[])?;
    let options = [on_gpu(g.uuid(0)), strings(&["--also", &second_path.display().to_string()])].concat();
    let mut sender = producer("broadcaster", "views", &first_path, &options, None, &[])?;
    for receiver in [&mut first, &mut second] {
        let report = receiver.report(Duration::from_secs(120))?;
        check_report(&report, &expect, &format!("{} ({})", receiver.name, report.note))?;
    }
    for _ in 0..2 {
        sender.expect("released", Duration::from_secs(60))?;
    }
    sender.finish(Duration::from_secs(30))?;
    first.finish(Duration::from_secs(30))?;
    second.finish(Duration::from_secs(30))
}

/// Two processes that each send and receive over NCCL (the benchmark's quick run: one-way
/// messages, round trips sent back on the receiver's stream, a 1,024-tensor message), with both
/// transports, and each returns from `main` at once: neither may crash on its way out (a worker
/// still inside NCCL at exit did, SIGSEGV).
fn both_ways_clean_exit(_: &Gpus) -> Result<()> {
    let mut child = Command::new(bin_path("tq-hosts")?).arg("--quick").stdout(Stdio::piped()).spawn()?;
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            child.kill()?;
            bail!("tq-hosts --quick did not finish within 240 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut table = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().context("stdout")?, &mut table)?;
    println!("{table}");
    ensure!(status.success(), "tq-hosts --quick: {status}");
    for transports in ["| default | 4 KiB round trip", "| net | 4 KiB round trip"] {
        ensure!(table.contains(transports), "no {transports:?} row");
    }
    Ok(())
}

/// NCCL's RAS service (2.24 on) keeps, per process, sockets to the processes it has met, and
/// closes those of processes that exited on its own timers: on an H200 pair the receiver held 2
/// such sockets (in the closed state) after four senders had exited, and none with RAS off. It
/// is off here so that the descriptors counted are tensor-queue's and its communicators'.
const NCCL_RAS_OFF: [(&str, &str); 1] = [("NCCL_RAS_ENABLE", "0")];

fn many_nccl(g: &Gpus) -> Result<()> {
    let env = [NCCL_RAS_OFF[0], ALWAYS_NCCL];
    let (mut consumer, path) = consumer("many-nccl", &over_tcp_onto(g), None, &env)?;
    // Round 0 pays NCCL's one-time set-up in this process; the baseline is taken after it, so
    // what rounds 1 and 2 (four more connections, four more communicators) leave is a leak.
    for (round, count) in [(0, "1000"), (1, "2000"), (2, "2000")] {
        let options = [on_gpu(g.uuid(0)), strings(&["--threads", "2", "--count", count, "--len", "4096"])].concat();
        let mut sender = producer(&format!("many-{round}"), "stream", &path, &options, None, &env)?;
        sender.expect("done", Duration::from_secs(300))?;
        sender.finish(Duration::from_secs(30))?;
        if round == 0 {
            std::thread::sleep(Duration::from_secs(2)); // its communicators are retired
            consumer.say("rebase")?;
            consumer.expect("rebased", Duration::from_secs(30))?;
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    consumer.poll();
    let reports = consumer.said.iter().filter(|l| l.starts_with("report ")).count();
    ensure!(reports == 10_000, "{reports} of 10,000 messages reported");
    let bad = consumer.said.iter().filter(|l| l.starts_with("report ") && !l.contains("\"ok\":true")).count();
    ensure!(bad == 0, "{bad} messages with other bytes");
    consumer.cursor = consumer.said.len();
    consumer.say("mem")?;
    let mem = consumer.expect("mem ", Duration::from_secs(30))?;
    ensure!(mem.starts_with("mem ok"), "after 10,000 messages over 6 connections: {mem}");
    consumer.finish(Duration::from_secs(30))
}

// ---------------------------------------------------------------- 6. small messages inline (issue 26)
//
// Across hosts (a TCP channel), a message whose GPU tensors total at most the sender's threshold
// (`TQ_INLINE_GPU_UP_TO`, 64 KiB by default) sends them inline in its TCP frame: the consumer
// sees them on its landing GPU with `TransferPath::Tcp` (never `Nccl`) and a stream there, and
// every byte is checked on the GPU as for NCCL.

/// The default threshold, set explicitly: the lead's environment must not change what is tested.
const INLINE_64K: (&str, &str) = (tensor_queue::route::INLINE_GPU_ENV, "65536");

/// What an inline GPU tensor shows at the consumer: bytes and stream on GPU 1, path `Tcp`.
fn inline_on(gpu1: &str) -> Expect<'static> {
    Expect { path: "Tcp", device: gpu1.to_string(), stream_device: gpu1.to_string() }
}

/// The producer's `route-4k` line: the route `Sender::route_for` gives a 4 KiB message.
fn route_4k(producer: &mut Proc) -> Result<String> {
    producer.value("route-4k ", Duration::from_secs(60))
}

/// One message per size (1 B, 4095 B, 1 MiB + 3, 64 MiB, 256 MiB): the two small ones inline
/// (path `Tcp` on GPU 1, bytes checked on the GPU), the others through NCCL, in order on one
/// channel; `Sender::route_for` reports the inline route beforehand.
fn inline_sizes(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let (mut consumer, path) = consumer("inline-sizes", &over_tcp_onto(g), None, &[])?;
    let mut producer = producer("inline-sizes", "sizes", &path, &on_gpu(g.uuid(0)), None, &[INLINE_64K])?;
    let (said_route, said_target) = route_line(&mut producer)?;
    ensure!(said_route == "Nccl" && said_target == gpu1, "Sender::route said {said_route} to {said_target}");
    let small = route_4k(&mut producer)?;
    ensure!(small == format!("Tcp target {gpu1} reason small message inline"), "route_for 4 KiB: {small}");
    for id in 0..5u64 {
        let report = consumer.report(Duration::from_secs(120))?;
        ensure!(report.id == id, "message {} arrived where {id} was due", report.id);
        let path = if id < 2 { "Tcp" } else { "Nccl" };
        let expect = Expect { path, device: gpu1.clone(), stream_device: gpu1.clone() };
        check_report(&report, &expect, &format!("sizes message {id} ({})", report.note))?;
    }
    producer.expect("released", Duration::from_secs(60))?;
    producer.finish(Duration::from_secs(30))?;
    consumer.finish(Duration::from_secs(30))
}

/// With the threshold at 64 KiB: 64 KiB tensors travel inline, 64 KiB + 1 through NCCL, on one
/// consumer; with the threshold at 0 a 4 KiB one goes through NCCL.
fn inline_threshold(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let (mut consumer, path) = consumer("inline-threshold", &over_tcp_onto(g), None, &[])?;
    let nccl = || Expect { path: "Nccl", device: gpu1.clone(), stream_device: gpu1.clone() };
    let cases: [(&str, usize, (&str, &str), Expect<'_>); 3] = [
        ("at", 64 << 10, INLINE_64K, inline_on(&gpu1)),
        ("above", (64 << 10) + 1, INLINE_64K, nccl()),
        ("never", 4096, ALWAYS_NCCL, nccl()),
    ];
    for (name, len, env, expect) in cases {
        let options = [on_gpu(g.uuid(0)), strings(&["--count", "3", "--len", &len.to_string()])].concat();
        let mut producer = producer(&format!("threshold-{name}"), "stream", &path, &options, None, &[env])?;
        for _ in 0..3 {
            let report = consumer.report(Duration::from_secs(120))?;
            check_report(&report, &expect, &format!("{name}: {len} B ({})", report.note))?;
        }
        producer.expect("released", Duration::from_secs(60))?;
        producer.finish(Duration::from_secs(30))?;
    }
    consumer.finish(Duration::from_secs(30))
}

/// One small message of a GPU tensor, a host tensor and a transposed GPU view: all inline, the
/// GPU ones landed on GPU 1 (a stream there), the host one in host memory, each as sent.
fn inline_mixed(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let (mut consumer, path) = consumer("inline-mixed", &over_tcp_onto(g), None, &[])?;
    let mut producer = producer("inline-mixed", "mixed", &path, &on_gpu(g.uuid(0)), None, &[INLINE_64K])?;
    let report = consumer.report(Duration::from_secs(120))?;
    ensure!(report.ok && !report.producer_failed, "the data differ: {report:?}");
    ensure!(report.paths == ["Tcp", "Tcp", "Tcp"], "paths {:?}", report.paths);
    ensure!(report.devices == [gpu1.as_str(), "host", gpu1.as_str()], "devices {:?}", report.devices);
    ensure!(report.stream_devices == [gpu1.as_str(), "none", gpu1.as_str()], "streams {:?}", report.stream_devices);
    ensure!(report.layouts[2].starts_with("[16, 64]/"), "the view arrived as {}", report.layouts[2]);
    producer.expect("released", Duration::from_secs(60))?;
    producer.finish(Duration::from_secs(30))?;
    consumer.finish(Duration::from_secs(30))
}

/// A producer whose 4 KiB tensor is filled after 2 s of GPU spinning sends it inline (its
/// `send_on` waits for the fill on the CPU: the bytes must be final) and is killed right after
/// `send_on` returned: the message had left the process, so it arrives whole, then the
/// receiver serves the next sender as before.
fn inline_killed_sender(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let (mut consumer, path) = consumer("inline-killed", &over_tcp_onto(g), None, &[])?;
    let options = [on_gpu(g.uuid(0)), strings(&["--len", "4096", "--spin-ms", "2000"])].concat();
    let mut doomed = producer("doomed", "spin-big", &path, &options, None, &[INLINE_64K])?;
    doomed.expect("sent 0 0", Duration::from_secs(60))?;
    let killed_at = Instant::now();
    doomed.kill()?;
    let outcome = killed_producer_outcome(&mut consumer, killed_at, Some(Duration::from_secs(10)))?;
    println!("the receiver after the kill ({:?}): {}", killed_at.elapsed(), short(&outcome));
    ensure!(outcome.starts_with("report "), "the message sent before the kill: {outcome}");
    let report: MsgReport = serde_json::from_str(&outcome["report ".len()..])?;
    ensure!(report.ok && report.seen == report.reference, "not whole: {report:?}");
    check_report(&report, &inline_on(&gpu1), "the killed producer's inline message")?;
    recovers(&mut consumer, &path, g, None, &Expect { path: "Nccl", device: gpu1.clone(), stream_device: gpu1 })?;
    consumer.finish(Duration::from_secs(30))
}

/// Two producer processes of four senders each (a connection and a stream per thread) send
/// 4 KiB messages to one consumer at once: every message arrives inline, whole, and the
/// consumer's memory and descriptors return to their baseline.
fn inline_many_senders(g: &Gpus) -> Result<()> {
    let gpu1 = g.uuid(1).to_string();
    let (mut consumer, path) = consumer("inline-many", &over_tcp_onto(g), None, &[])?;
    // A first sender pays the one-time set-up (the host arena's registration, the landing
    // GPU's arena); the baseline is taken after it, so what the 8 senders leave is a leak.
    let mut first = producer("inline-first", "mixed", &path, &on_gpu(g.uuid(0)), None, &[INLINE_64K])?;
    consumer.report(Duration::from_secs(60))?;
    first.expect("released", Duration::from_secs(60))?;
    first.finish(Duration::from_secs(30))?;
    std::thread::sleep(Duration::from_secs(2)); // its connection is retired
    consumer.say("rebase")?;
    consumer.expect("rebased", Duration::from_secs(30))?;
    let options = [on_gpu(g.uuid(0)), strings(&["--threads", "4", "--count", "250", "--len", "4096"])].concat();
    let mut producers = Vec::new();
    for k in 0..2 {
        producers.push(producer(&format!("inline-many-{k}"), "stream", &path, &options, None, &[INLINE_64K])?);
    }
    for sender in &mut producers {
        sender.expect("done", Duration::from_secs(300))?;
        sender.finish(Duration::from_secs(30))?;
    }
    let expect = inline_on(&gpu1);
    for n in 0..2000 {
        let report = consumer.report(Duration::from_secs(60)).with_context(|| format!("report {n} of 2,000"))?;
        check_report(&report, &expect, &format!("message {n} ({})", report.note))?;
    }
    consumer.cursor = consumer.said.len();
    consumer.say("mem")?;
    let mem = consumer.expect("mem ", Duration::from_secs(30))?;
    ensure!(mem.starts_with("mem ok"), "after 2,000 inline messages from 8 senders: {mem}");
    consumer.finish(Duration::from_secs(30))
}
