//! An outside tester's tests of the messages users send, written from the README and the rustdoc
//! only, with the other end a separate program (`outside-msg-peer`): many tensors and views of one
//! storage per message, a consumer holding hundreds of messages, several senders per process, peers
//! killed at the worst moment, a receiver that stops reading, TCP with odd sizes and a wrong
//! secret, and the typed errors a caller matches on.
//!
//! Every wait has a bound that fails the test; none is a speed assertion. GPU variants are
//! reported as ignored, with the reason, where there is no GPU.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::outside_messages::{
    Held, MIXED, Many, OverTcp, Tagged, check_many, check_mixed_storages, check_over_tcp, check_shared_storage,
    check_tagged, held, many, mixed_storages, shared_storage, tagged,
};
use integration_tests::{bin_path, gpu_skip_reason, note_gpu_skips, socket_path, stdout_lines};
use libtest_mimic::{Arguments, Completion, Failed, Trial};
use tensor_queue::{
    Context, DType, Error, Receiver, Secret, Sender, Stream, Tensor, TensorProblem, TransferPath, memory,
};

/// The bound on any one wait: far past what a healthy run takes, short of a CI job's patience.
const BOUND: Duration = Duration::from_secs(30);

type Test = fn() -> Result<()>;

fn main() {
    let host: &[(&str, Test)] = &[
        ("many_tensors_and_views_of_one_storage_reach_a_separate_process_exactly", many_tensors_to_a_child),
        ("many_tensors_from_a_separate_process_arrive_exactly_with_their_layouts", many_tensors_from_a_peer),
        ("views_of_one_writable_storage_are_one_memory_in_the_receiver", views_alias_in_the_receiver),
        ("a_storage_shared_by_a_thousand_tensors_is_held_until_the_last_is_dropped", shared_storage_held_until_last),
        ("messages_of_1024_views_of_one_and_of_several_storages_arrive_exactly", mixed_storages_arrive_exactly),
        ("malformed_views_and_shapes_are_typed_errors_never_panics", malformed_views_are_typed_errors),
        ("typed_errors_for_bad_input_and_a_closed_receiver", typed_errors_for_bad_input),
        ("consumer_holding_hundreds_then_dropping_in_random_order_gives_everything_back", consumer_holds_hundreds),
        ("receiver_closed_while_holding_keeps_the_memory_until_it_drops_the_messages", receiver_closed_while_holding),
        ("receiver_killed_while_holding_many_leased_messages_gives_everything_back", receiver_killed_while_holding),
        ("a_hundred_connections_from_one_process_lose_nothing", a_hundred_connections_from_one_process),
        ("several_senders_per_process_keep_their_order_and_lose_nothing", several_senders_per_process),
        ("sender_returning_from_main_right_after_sending_loses_nothing", sender_exits_right_after_sending),
        ("sender_killed_right_after_sending_before_the_receiver_looked_loses_nothing", sender_killed_before_look),
        (
            "sender_killed_as_soon_as_send_returned_delivers_an_exact_prefix_then_the_end",
            sender_killed_right_after_send_returned,
        ),
        ("sender_killed_before_sending_anything_ends_the_stream", sender_killed_before_sending_anything),
        ("receiver_killed_while_a_send_waits_for_credits_is_a_typed_error", receiver_killed_while_a_send_waits),
        ("sender_killed_while_the_receiver_holds_its_tensors_leaves_them_intact", sender_killed_while_held),
        ("receiver_that_stops_reading_makes_sends_time_out_typed_then_resume", receiver_stops_reading),
        ("tcp_receiver_that_stops_reading_makes_sends_time_out_typed_then_resume", tcp_receiver_stops_reading),
        ("capacity_one_and_thousands_of_messages_lose_nothing_and_keep_order", tiny_capacity_many_messages),
        ("tcp_many_tensors_odd_sizes_and_views_arrive_exactly", tcp_many_tensors_and_odd_sizes),
        ("tcp_wrong_secret_is_a_typed_error_and_the_honest_sender_goes_on", tcp_wrong_secret),
        ("bool_tensors_hold_only_0_or_1", bool_tensors_hold_only_0_or_1),
        ("huge_timeouts_are_long_waits_never_panics", huge_timeouts_never_panic),
    ];
    let gpu: &[(&str, Test)] = &[
        ("gpu_many_tensors_and_views_reach_a_separate_process_exactly", gpu_many_tensors_to_a_child),
        ("gpu_consumer_holding_many_then_dropping_in_random_order_gives_everything_back", gpu_consumer_holds_many),
        (
            "gpu_sender_killed_right_after_sending_before_the_receiver_looked_loses_nothing",
            gpu_sender_killed_before_look,
        ),
    ];
    // Tests of bugs found on main are listed here, reported as ignored until fixed (none now).
    let bugs: &[(&str, &str, Test)] = &[];
    let mut trials: Vec<Trial> = host.iter().map(|&(name, run)| Trial::test(name, move || outcome(run))).collect();
    let arguments = Arguments::from_args();
    let run_bugs = arguments.ignored || arguments.include_ignored;
    for &(name, why, run) in bugs {
        trials.push(match run_bugs {
            // Selected by --ignored, as #[ignore] tests are.
            true => Trial::test(name, move || outcome(run)).with_ignored_flag(true),
            // Otherwise reported as ignored with the bug's description.
            false => Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why))),
        });
    }
    let no_gpu = gpu_skip_reason();
    for &(name, run) in gpu {
        let no_gpu = no_gpu.clone();
        trials.push(Trial::ignorable_test(name, move || match no_gpu {
            Some(_) => Ok(Completion::ignored_with("no GPU")),
            None => outcome(run).map(|()| Completion::Completed),
        }));
    }
    let conclusion = libtest_mimic::run(&arguments, trials);
    if let Some(reason) = no_gpu {
        note_gpu_skips(gpu.len(), &reason);
    }
    conclusion.exit()
}

fn outcome(run: Test) -> Result<(), Failed> {
    run().map_err(|e| Failed::from(format!("{e:#}")))
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// Tests that read `memory::usage()` (process-wide) take this exclusively; every other test that
/// makes tensors in this process holds it shared, so no other test's tensors come and go meanwhile.
static MEMORY: RwLock<()> = RwLock::new(());

fn shared_memory_use() -> RwLockReadGuard<'static, ()> {
    MEMORY.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn exclusive_memory_use() -> RwLockWriteGuard<'static, ()> {
    MEMORY.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A second process, its stdout as lines; killed and reaped if the test ends first.
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
    role: String,
}

impl Peer {
    fn command(role: &str, args: &[&str]) -> Result<Command> {
        let mut command = Command::new(bin_path("outside-msg-peer")?);
        command.arg(role).args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
        Ok(command)
    }

    /// Starts `outside-msg-peer ROLE ARGS` with `env`.
    fn start(role: &str, args: &[&str], env: &[(&str, &str)]) -> Result<Peer> {
        let mut command = Peer::command(role, args)?;
        command.envs(env.iter().copied());
        let child = command.spawn().context("starting outside-msg-peer")?;
        Ok(Peer::from_child(child, role))
    }

    /// Starts `outside-msg-peer ROLE ARGS` as a child with a channel to it (`tensor_queue::spawn`).
    fn spawn<T: serde::Serialize>(role: &str, args: &[&str]) -> Result<(Peer, Sender<T>)> {
        let (child, sender) = tensor_queue::spawn::<T>(&mut Peer::command(role, args)?)?;
        Ok((Peer::from_child(child, role), sender))
    }

    fn from_child(mut child: Child, role: &str) -> Peer {
        let lines = stdout_lines(&mut child, Some(format!("peer {role}")));
        Peer { child, lines, role: role.to_string() }
    }

    /// The next line it prints; an `error` line, its exit or silence for [`BOUND`] fail the test.
    fn line(&self) -> Result<String> {
        let line = self
            .lines
            .recv_timeout(BOUND)
            .with_context(|| format!("peer {} said nothing within {BOUND:?}", self.role))?;
        ensure!(!line.starts_with("error"), "peer {}: {line}", self.role);
        Ok(line)
    }

    /// Waits for the line `expected`.
    fn expect(&self, expected: &str) -> Result<()> {
        let line = self.line()?;
        ensure!(line == expected, "peer {} said {line:?}, expected {expected:?}", self.role);
        Ok(())
    }

    fn write(&mut self, line: &str) -> Result<()> {
        let stdin = self.child.stdin.as_mut().context("peer's stdin")?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    /// Closes its stdin and waits (bounded) for it to exit successfully.
    fn finish(mut self) -> Result<()> {
        drop(self.child.stdin.take());
        let status = self.wait_exit()?;
        ensure!(status.success(), "peer {} exited with {status}", self.role);
        Ok(())
    }

    fn wait_exit(&mut self) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + BOUND;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            ensure!(Instant::now() < deadline, "peer {} did not exit within {BOUND:?}", self.role);
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILLs it and reaps it: it is gone when this returns.
    fn kill(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `f` on a thread of its own; fails if it has not returned within `bound` (a hang).
fn within<R: Send + 'static>(bound: Duration, what: &str, f: impl FnOnce() -> R + Send + 'static) -> Result<R> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(bound).map_err(|_| anyhow::anyhow!("{what} did not return within {bound:?}"))
}

/// Polls `done` until it holds; fails after [`BOUND`].
fn wait_until(what: &str, mut done: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + BOUND;
    while !done() {
        ensure!(Instant::now() < deadline, "{what}: not within {BOUND:?}");
        thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// The seed of a random order: `TQ_OUTSIDE_SEED` replays one, else the clock picks it. Printed.
fn seed() -> u64 {
    let seed = std::env::var("TQ_OUTSIDE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!("random order seed {seed} (replay with TQ_OUTSIDE_SEED={seed})");
    seed
}

/// Bytes of the tensors of [`held`] messages `ids`.
fn held_bytes(ids: impl Iterator<Item = u64>) -> Result<usize> {
    let mut total = 0;
    for id in ids {
        total += held(id)?.tensors.iter().map(Tensor::nbytes).sum::<usize>();
    }
    Ok(total)
}

/// The whole process's arena memory is back where it started: no more in use than `before`, and
/// after `trim` no more chunks than before.
fn memory_back_to(before: &memory::MemoryUsage) -> Result<()> {
    // (At most: tensors an earlier test sent may have been released since.)
    wait_until("in-use bytes back to their start", || memory::usage().in_use_bytes <= before.in_use_bytes)
        .with_context(|| format!("now {:?}, at the start {before:?}", memory::usage()))?;
    memory::trim();
    let after = memory::usage();
    ensure!(after.host_bytes <= before.host_bytes, "host chunks after trim {after:?}, at the start {before:?}");
    ensure!(after.device_bytes <= before.device_bytes, "device chunks after trim {after:?}, at the start {before:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Many tensors per message, views of one storage.

fn many_tensors_to_a_child() -> Result<()> {
    let _memory = shared_memory_use();
    let (peer, sender) = Peer::spawn::<Many>("recv-many", &[])?;
    for id in 0..3 {
        sender.send(&many(id, None)?)?;
    }
    for id in 0..3 {
        peer.expect(&format!("ok {id}"))?;
    }
    ensure!(sender.wait_released(BOUND), "the child still holds tensors after checking them");
    ensure!(sender.outstanding_leases() == 0, "{} leases outstanding", sender.outstanding_leases());
    drop(sender);
    peer.expect("done 3")?;
    peer.finish()
}

fn many_tensors_from_a_peer() -> Result<()> {
    let _memory = shared_memory_use();
    let (mut receiver, peer) = many_from("send-many", "om-many", 2, &["--first", "5"])?;
    let mut holding = Vec::new();
    for id in 5..7 {
        let message = receiver.recv_timeout(BOUND)?;
        ensure!(message.id == id, "message {} arrived where {id} was due", message.id);
        check_many(&message, true)?;
        for t in message.small.iter().chain(&message.views) {
            ensure!(t.path() == TransferPath::HostSharedMemory, "a host tensor came by {:?}", t.path());
        }
        holding.push(message);
    }
    peer.expect("sent")?;
    peer.expect("written")?;
    // The sender's program ends normally while this process holds its tensors: it exits (its
    // Sender's drop waits for nothing this side holds) and what it sent stays as it was.
    peer.finish()?;
    for message in &holding {
        check_many(message, true)?;
    }
    expect_end(&mut receiver, "its only sender left")
}

fn views_alias_in_the_receiver() -> Result<()> {
    let _memory = shared_memory_use();
    let base = Tensor::zeros_writable(DType::I32, &[64, 64])?;
    let (mut peer, sender) = Peer::spawn::<(Tensor, Tensor)>("alias", &[])?;
    // Two overlapping views of one storage: rows 0..40 and rows 2..42.
    sender.send(&(base.narrow(0, 0, 40)?, base.narrow(0, 2, 40)?))?;
    peer.expect("b sees 4242")?;
    ensure!(base.get::<i32>(&[5, 3])? == 4242, "the sender does not see the receiver's write");
    ensure!(base.get::<i32>(&[5, 4])? == 0 && base.get::<i32>(&[3, 3])? == 0, "the write landed elsewhere too");
    peer.write("")?;
    peer.finish()
}

/// Issue 26's many-tensor message, both ways: 1,024 tensors of one storage (views) and of
/// several (views of two storages and tensors of their own, interleaved) reach a separate
/// process exactly, message after message, and come back from it exactly.
fn mixed_storages_arrive_exactly() -> Result<()> {
    let _memory = shared_memory_use();
    let (peer, sender) = Peer::spawn::<(u64, Vec<Tensor>)>("recv-mixed", &[])?;
    for id in 0..4 {
        sender.send(&(id, mixed_storages(id)?))?;
        peer.expect(&format!("ok {id} {MIXED}"))?;
    }
    drop(sender);
    peer.expect("done")?;
    peer.finish()?;
    // And into this process, from a sender of its own (a receiver here, the peer's tensors).
    let path = socket_path("mixed-1024");
    let mut receiver = Receiver::<(u64, Vec<Tensor>)>::bind(&path)?;
    let to = path.to_string_lossy();
    let mut peer = Peer::start("send-mixed", &["--to", &to, "--count", "3"], &[])?;
    for n in 0..3 {
        let (id, tensors) = receiver.recv_timeout(BOUND)?;
        ensure!(id == n, "message {id} came as number {n}");
        check_mixed_storages(id, &tensors)?;
        ensure!(tensors.iter().all(|t| t.path() == TransferPath::HostSharedMemory), "a tensor came another way");
    }
    let (id, views) = receiver.recv_timeout(BOUND)?; // 1,024 views of one storage
    ensure!(id == 99, "the views of one storage came as message {id}");
    check_shared_storage(5, &views)?;
    peer.expect("sent")?;
    peer.write("")?;
    peer.finish()
}

fn shared_storage_held_until_last() -> Result<()> {
    let _memory = shared_memory_use();
    let (mut peer, sender) = Peer::spawn::<Vec<Tensor>>("partial", &[])?;
    sender.send(&shared_storage(3)?)?;
    peer.expect("ok 1024")?;
    ensure!(sender.outstanding_leases() == 1, "{} leases for one message held", sender.outstanding_leases());
    peer.write("drop all but one")?;
    peer.expect("1 left")?;
    ensure!(
        !sender.wait_released(Duration::from_millis(50)),
        "released while the receiver still holds one of its tensors"
    );
    ensure!(
        sender.outstanding_leases() == 1,
        "{} leases while one tensor of the message is held",
        sender.outstanding_leases()
    );
    peer.write("drop the last")?;
    peer.expect("0 left")?;
    ensure!(sender.wait_released(BOUND), "not released after the receiver dropped the message's last tensor");
    ensure!(sender.outstanding_leases() == 0, "{} leases outstanding", sender.outstanding_leases());
    drop(sender);
    peer.finish()
}

/// Runs `f`, catching a panic (which is a failure of its own, not a refusal).
fn attempt(f: impl FnOnce() -> tensor_queue::Result<Tensor>) -> std::thread::Result<tensor_queue::Result<Tensor>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
}

fn malformed_views_are_typed_errors() -> Result<()> {
    let _memory = shared_memory_use();
    let t = Tensor::new(&(0..24).collect::<Vec<i32>>(), &[2, 3, 4])?;
    let max = tensor_queue::MAX_DIMS;
    let attempts: Vec<(&str, std::thread::Result<tensor_queue::Result<Tensor>>)> = vec![
        ("one dimension too many", attempt(|| Tensor::zeros(DType::U8, &vec![1; max + 1]))),
        ("transpose past the dims", attempt(|| t.transpose(0, 3))),
        ("permute naming a dim twice", attempt(|| t.permute(&[0, 0, 1]))),
        ("permute missing a dim", attempt(|| t.permute(&[0, 1]))),
        ("narrow past the end", attempt(|| t.narrow(2, 3, 2))),
        ("narrow with u64::MAX", attempt(|| t.narrow(1, u64::MAX, 2))),
        ("slice start past end", attempt(|| t.slice(2, 3, 1, 1))),
        ("slice step 0", attempt(|| t.slice(2, 0, 4, 0))),
        ("select out of range", attempt(|| t.select(0, 2))),
        ("select past the dims", attempt(|| t.select(3, 0))),
        ("expand a size that is not 1", attempt(|| t.expand(&[2, 5, 4]))),
        ("expand to fewer dims", attempt(|| t.expand(&[4]))),
        ("flip a dim twice", attempt(|| t.flip(&[1, 1]))),
        ("flip past the dims", attempt(|| t.flip(&[3]))),
        ("reshape to another count", attempt(|| t.reshape(&[5, 5]))),
        ("reshape a strided view", attempt(|| t.transpose(0, 2).and_then(|v| v.reshape(&[24])))),
        ("layout far past the storage", attempt(|| t.as_layout(DType::I32, &[1 << 30], &[1], 0))),
        ("layout unaligned", attempt(|| t.as_layout(DType::I32, &[2], &[1], 2))),
        ("layout with a negative stride before the start", attempt(|| t.as_layout(DType::I32, &[2], &[-1], 0))),
        ("layout with stride overflow", attempt(|| t.as_layout(DType::U8, &[2, 2], &[i64::MAX, 1], 0))),
        ("layout dims and strides of different lengths", attempt(|| t.as_layout(DType::I32, &[2, 2], &[1], 0))),
        ("overflowing shape", attempt(|| Tensor::zeros(DType::F64, &[u64::MAX, 2]))),
        ("overflowing shape from data", attempt(|| Tensor::new(&[1u8], &[usize::MAX, 2]))),
    ];
    for (what, result) in attempts {
        match result {
            Err(_) => bail!("{what}: panicked"),
            Ok(Ok(view)) => bail!("{what}: accepted, shape {:?} strides {:?}", view.shape(), view.strides()),
            // A view that cannot be made names the call; a layout or shape that cannot exist is a
            // tensor problem.
            Ok(Err(Error::View { .. } | Error::Tensor(_))) => {}
            Ok(Err(other)) => bail!("{what}: {other:?}, expected Error::View or Error::Tensor"),
        }
    }
    // The most dimensions are accepted and cross a channel (exactly checked in the tests above).
    ensure!(Tensor::zeros(DType::U8, &vec![1; max])?.shape().len() == max);
    // Views that are odd but valid are not refused: an empty slice at the very end, a 0-d view.
    ensure!(t.slice(2, 4, 4, 1)?.numel() == 0 && t.select(0, 1)?.select(0, 2)?.select(0, 3)?.get::<i32>(&[])? == 23);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Typed errors.

fn typed_errors_for_bad_input() -> Result<()> {
    let _memory = shared_memory_use();
    // Mismatched data length.
    match Tensor::from_slice(&[1.0f32, 2.0], DType::F32, &[3]) {
        Err(Error::Tensor(TensorProblem::LengthMismatch { .. })) => {}
        other => bail!("2 elements for 3: {other:?}"),
    }
    match Tensor::from_bytes(&[0u8; 7], DType::I32, &[2]) {
        Err(Error::Tensor(TensorProblem::LengthMismatch { .. })) => {}
        other => bail!("7 bytes for 2 i32: {other:?}"),
    }
    match Tensor::new(&[1u8, 2], &[3]) {
        Err(Error::Tensor(TensorProblem::LengthMismatch { .. })) => {}
        other => bail!("Tensor::new, 2 elements for 3: {other:?}"),
    }
    // Wrong dtype: data of another element type, and reading as another element type.
    match Tensor::from_slice(&[1.0f64], DType::F32, &[1]) {
        Err(Error::Tensor(TensorProblem::DTypeMismatch { .. } | TensorProblem::ElementBytes { .. })) => {}
        other => bail!("f64 data for an F32 tensor: {other:?}"),
    }
    let t = Tensor::from_slice(&[1i32, 2], DType::I32, &[2])?;
    match t.to_vec::<f32>() {
        Err(Error::Tensor(TensorProblem::DTypeMismatch { .. })) => {}
        other => bail!("an I32 tensor read as f32: {other:?}"),
    }
    match t.get::<i64>(&[0]) {
        Err(Error::Tensor(TensorProblem::DTypeMismatch { .. } | TensorProblem::ElementBytes { .. })) => {}
        other => bail!("an I32 element read as i64: {other:?}"),
    }
    match Tensor::build_as::<f32>(DType::F64, &[1], |_| ()) {
        Err(Error::Tensor(TensorProblem::DTypeMismatch { .. } | TensorProblem::ElementBytes { .. })) => {}
        other => bail!("build_as f32 elements for F64: {other:?}"),
    }
    // Bad endpoints and nothing listening.
    match Sender::<u32>::connect("http://localhost:7000") {
        Err(Error::BadEndpoint { .. }) => {}
        other => bail!("an http endpoint: {:?}", other.map(|_| ())),
    }
    match Sender::<u32>::connect(socket_path("om-nobody")) {
        Err(Error::NoReceiver { .. }) => {}
        other => bail!("nothing bound there: {:?}", other.map(|_| ())),
    }
    // Capacity 0 ("at least 1") is refused, or taken as 1: never a channel nothing can cross.
    let zero = socket_path("om-cap0");
    match Receiver::<u32>::builder().capacity(0).bind(&zero) {
        Err(Error::Invalid(_)) => {}
        Ok(mut receiver) => {
            let sender = Sender::<u32>::connect(&zero)?;
            sender.send_timeout(&7, BOUND).context("the one message a capacity-0 receiver must still take")?;
            ensure!(receiver.recv_timeout(BOUND)? == 7, "capacity 0");
        }
        Err(other) => bail!("capacity 0: {other:?}"),
    }
    match Secret::from_bytes(*b"short") {
        Err(Error::SecretTooShort { len: 5, .. }) => {}
        other => bail!("a 5-byte secret: {other:?}"),
    }

    // Sending to a closed receiver (dropped in this process), then to one killed in another.
    let path = socket_path("om-closed");
    let mut receiver = Receiver::<Tensor>::bind(&path)?;
    let sender = Sender::<Tensor>::connect(&path)?;
    sender.send(&t)?;
    let received = receiver.recv_timeout(BOUND)?;
    // A received tensor cannot be sent on as it is; a copy can.
    match sender.send(&received) {
        Err(Error::NotSendable(_)) => {}
        other => bail!("sending a received tensor on: {other:?}"),
    }
    // A message too large for one frame is refused before anything is sent; the channel goes on.
    // (A string: serde writes its bytes at once, where a Vec<u8> goes element by element.)
    let huge = Sender::<String>::connect(&path)?;
    let limit = tensor_queue::MAX_MESSAGE_BYTES;
    match huge.send(&"x".repeat(limit + 1)) {
        Err(Error::TooLarge { size, limit: l }) => ensure!(size > l && l == limit, "TooLarge {{ {size}, {l} }}"),
        other => bail!("a {limit}+1-byte payload: {other:?}"),
    }
    drop(huge);
    sender.send(&received.copy()?)?;
    ensure!(receiver.recv_timeout(BOUND)?.to_vec::<i32>()? == [1, 2], "the channel goes on after the refusals");
    drop(received);
    drop(receiver);
    wait_until("the sender sees its receiver closed", || !sender.is_connected())?;
    let sender = within(BOUND, "send to a closed receiver", move || match sender.send(&Tensor::new(&[1u8], &[1])?) {
        Err(Error::Disconnected) => Ok(sender),
        other => bail!("send to a dropped receiver: {other:?}"),
    })??;
    match sender.send_timeout(&Tensor::new(&[1u8], &[1])?, Duration::from_millis(100)) {
        Err(Error::Disconnected) => {}
        other => bail!("send_timeout to a dropped receiver: {other:?}"),
    }
    match sender.try_send(&Tensor::new(&[1u8], &[1])?) {
        Err(Error::Disconnected) => {}
        other => bail!("try_send to a dropped receiver: {other:?}"),
    }

    let (mut peer, sender) = Peer::spawn::<Held>("reader", &["--capacity", "4"])?;
    peer.expect("ready")?;
    sender.wait_ready(BOUND)?;
    peer.kill()?;
    wait_until("the sender sees its receiver's process gone", || !sender.is_connected())?;
    within(BOUND, "send to a killed receiver", move || match sender.send(&held(1)?) {
        Err(Error::Disconnected) => Ok(()),
        other => bail!("send to a killed receiver: {other:?}"),
    })?
}

/// Every wait that takes a timeout, given `Duration::MAX` where it can return at once: a result,
/// never a panic. (A caller's "forever" is a long wait, not an overflow.)
fn huge_timeouts_never_panic() -> Result<()> {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let _memory = shared_memory_use();
    let forever = Duration::MAX;
    let path = socket_path("om-forever");
    let mut receiver = Receiver::<u32>::bind(&path)?;
    let sender = Sender::<u32>::connect(&path)?;
    let secret = Secret::from_bytes(KEY)?;
    let tcp = Receiver::<u32>::builder().secret(secret.clone()).bind("tcp://127.0.0.1:0")?;
    let tcp_endpoint = format!("tcp://{}", tcp.local_addr().context("bound to TCP")?);
    let mut panicked = Vec::new();
    let mut check = |what: &str, call: &mut dyn FnMut() -> Result<()>| match catch_unwind(AssertUnwindSafe(call)) {
        Ok(result) => result.with_context(|| what.to_string()).map(|()| true),
        Err(_) => {
            panicked.push(what.to_string());
            Ok(false)
        }
    };
    check("Sender::wait_ready", &mut || Ok(sender.wait_ready(forever)?))?;
    if !check("Sender::send_timeout", &mut || Ok(sender.send_timeout(&1, forever)?))? {
        sender.send(&1)?; // so that the receive below returns at once
    }
    check("Receiver::recv_timeout", &mut || {
        ensure!(receiver.recv_timeout(forever)? == 1);
        Ok(())
    })?;
    sender.send(&2)?;
    check("Receiver::recv_with_info", &mut || {
        ensure!(receiver.recv_with_info(Some(forever))?.0 == 2);
        Ok(())
    })?;
    check("Sender::wait_released", &mut || {
        ensure!(sender.wait_released(forever));
        Ok(())
    })?;
    check("Sender::wait_written", &mut || {
        ensure!(sender.wait_written(forever));
        Ok(())
    })?;
    check("SenderBuilder::timeout(..).connect over TCP", &mut || {
        Sender::<u32>::builder().secret(secret.clone()).timeout(forever).connect(tcp_endpoint.as_str())?;
        Ok(())
    })?;
    check("spawn_timeout", &mut || {
        // A child that exits at once: an error, at once, whatever the timeout.
        match tensor_queue::spawn_timeout::<u32>(&mut Command::new("true"), forever) {
            Err(Error::ChildNotReady { .. } | Error::Invalid(_)) => Ok(()),
            other => bail!("a child that never takes its end: {:?}", other.map(|_| ())),
        }
    })?;
    ensure!(panicked.is_empty(), "panicked with a timeout of Duration::MAX: {}", panicked.join(", "));
    Ok(())
}

/// `DType::Bool` is "one byte, 0 or 1": other bytes are refused where a tensor is made or
/// written, so no receiver (NumPy, torch) is handed a bool that is neither.
fn bool_tensors_hold_only_0_or_1() -> Result<()> {
    let _memory = shared_memory_use();
    match Tensor::from_bytes(&[0, 1, 2, 7], DType::Bool, &[4]) {
        Err(Error::Tensor(TensorProblem::NotABool { .. })) => {}
        other => bail!("Bool bytes 2 and 7: {:?}", other.map(|t| t.to_vec::<u8>())),
    }
    let t = Tensor::zeros(DType::Bool, &[2])?;
    ensure!(
        matches!(t.set(&[0], 5u8), Err(Error::Tensor(TensorProblem::NotABool { .. }))),
        "set a Bool to 5: {:?}",
        t.to_vec::<u8>()
    );
    ensure!(
        matches!(t.fill(3u8), Err(Error::Tensor(TensorProblem::NotABool { .. }))),
        "fill a Bool with 3: {:?}",
        t.to_vec::<u8>()
    );
    t.fill(1u8)?;
    ensure!(t.to_vec::<u8>()? == [1, 1]);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// A consumer holding many messages.

fn consumer_holds_hundreds() -> Result<()> {
    let _memory = exclusive_memory_use();
    const COUNT: u64 = 300;
    let before = memory::usage();
    let (mut peer, sender) = Peer::spawn::<Held>("hold", &["--count", "300", "--capacity", "300"])?;
    for id in 0..COUNT {
        sender.send(&held(id)?)?; // the sender drops its own handles at once: only leases keep them
    }
    peer.expect("holding 300")?;
    let with_tensors = (0..COUNT).filter(|id| id % 3 != 0).count();
    ensure!(
        sender.outstanding_leases() == with_tensors,
        "{} leases outstanding while the receiver holds {with_tensors} messages with tensors (and {} without)",
        sender.outstanding_leases(),
        COUNT as usize - with_tensors
    );
    let held_now = held_bytes(0..COUNT)?;
    let usage = memory::usage();
    ensure!(usage.in_use_bytes >= held_now, "{usage:?} while {held_now} bytes are held (start {before:?})");
    ensure!(
        !sender.wait_released(Duration::from_millis(10)),
        "wait_released says released while the receiver holds them"
    );

    peer.write(&format!("drop {}", seed()))?;
    peer.expect("dropped")?;
    ensure!(
        sender.wait_released(BOUND),
        "{} leases still outstanding after the receiver dropped everything",
        sender.outstanding_leases()
    );
    ensure!(sender.outstanding_leases() == 0, "{} leases outstanding", sender.outstanding_leases());
    memory_back_to(&before)?;
    // The channel still works after all that.
    sender.send(&held(COUNT + 1)?)?;
    drop(sender);
    peer.finish()
}

fn receiver_closed_while_holding() -> Result<()> {
    let _memory = shared_memory_use();
    let (mut peer, sender) = Peer::spawn::<Held>("hold", &["--count", "50", "--capacity", "50"])?;
    for id in 0..50 {
        sender.send(&held(id)?)?;
    }
    peer.expect("holding 50")?;
    peer.write("close")?;
    peer.expect("closed")?; // its Receiver is gone; it still holds the messages, intact
    wait_until("is_connected turns false once the receiver closed", || !sender.is_connected())?;
    match sender.send(&held(1)?) {
        Err(Error::Disconnected) => {}
        other => bail!("send to a closed receiver: {other:?}"),
    }
    // Never released before the receiver drops them.
    ensure!(!sender.wait_released(Duration::from_millis(50)), "released while the closed receiver still holds them");
    let with_tensors = (0..50).filter(|id| id % 3 != 0).count();
    ensure!(
        sender.outstanding_leases() == with_tensors,
        "{} leases outstanding, {with_tensors} held",
        sender.outstanding_leases()
    );
    peer.write(&format!("drop {}", seed()))?;
    peer.expect("dropped")?;
    ensure!(
        sender.wait_released(BOUND),
        "{} leases outstanding after the receiver dropped all",
        sender.outstanding_leases()
    );
    drop(sender);
    peer.finish()
}

fn receiver_killed_while_holding() -> Result<()> {
    let _memory = exclusive_memory_use();
    const COUNT: u64 = 200;
    let before = memory::usage();
    let (mut peer, sender) = Peer::spawn::<Held>("hold", &["--count", "200", "--capacity", "200"])?;
    for id in 0..COUNT {
        sender.send(&held(id)?)?;
    }
    peer.expect("holding 200")?;
    ensure!(sender.outstanding_leases() > 0, "nothing leased while the receiver holds {COUNT} messages");
    peer.kill()?;
    ensure!(
        sender.wait_released(BOUND),
        "{} leases still outstanding after the receiver was killed",
        sender.outstanding_leases()
    );
    ensure!(sender.outstanding_leases() == 0, "{} leases outstanding", sender.outstanding_leases());
    wait_until("is_connected turns false", || !sender.is_connected())?;
    within(BOUND, "send to a killed receiver", move || match sender.send(&held(1)?) {
        Err(Error::Disconnected) => Ok(()),
        other => bail!("send after the receiver was killed: {other:?}"),
    })??;
    memory_back_to(&before)
}

// ---------------------------------------------------------------------------------------------
// Several senders.

fn several_senders_per_process() -> Result<()> {
    let _memory = shared_memory_use();
    const COUNT: u64 = 150;
    let path = socket_path("om-senders");
    let mut receiver = Receiver::<Tagged>::bind(&path)?;
    // Two processes with 3 connections each (4 threads: one sends through a clone), and this
    // process with 2 more: 8 connections.
    receiver.expect_senders(8);
    let path_text = path.to_str().context("socket path")?.to_string();
    let args = ["--to", &path_text, "--senders", "3", "--clones", "1", "--count", "150"];
    let peers = [Peer::start("senders", &args, &[])?, Peer::start("senders", &args, &[])?];
    let locals: Vec<_> = (0..2u32)
        .map(|s| {
            let path = path.clone();
            thread::spawn(move || -> Result<()> {
                let sender = Sender::<Tagged>::connect(&path)?;
                for seq in 0..COUNT {
                    sender.send(&tagged(std::process::id(), 100 + s, seq)?)?;
                }
                Ok(())
            })
        })
        .collect();
    let got = within(Duration::from_secs(60), "receiving from 8 senders until the end", move || -> Result<_> {
        let mut by_sender: BTreeMap<(u32, u32), Vec<u64>> = BTreeMap::new();
        for message in receiver.iter() {
            let message = message?;
            check_tagged(&message)?;
            by_sender.entry((message.pid, message.sender)).or_default().push(message.seq);
        }
        Ok(by_sender)
    })??;
    for local in locals {
        local.join().map_err(|_| anyhow::anyhow!("a local sender panicked"))??;
    }
    for peer in peers {
        peer.expect("done")?;
        peer.finish()?;
    }
    ensure!(got.len() == 2 * 4 + 2, "messages from {} senders, expected 10: {:?}", got.len(), got.keys());
    for ((pid, sender), seqs) in got {
        ensure!(
            seqs == (0..COUNT).collect::<Vec<_>>(),
            "pid {pid} sender {sender}: {} messages, out of order or lost",
            seqs.len()
        );
    }
    Ok(())
}

fn a_hundred_connections_from_one_process() -> Result<()> {
    let _memory = shared_memory_use();
    let path = socket_path("om-hundred");
    let mut receiver = Receiver::<Tagged>::bind(&path)?;
    receiver.expect_senders(100);
    let path_text = path.to_str().context("socket path")?.to_string();
    let peer = Peer::start("senders", &["--to", &path_text, "--senders", "100", "--count", "4"], &[])?;
    let got =
        within(Duration::from_secs(60), "receiving from 100 connections until the end", move || -> Result<_> {
            let mut by_sender: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
            for message in receiver.iter() {
                let message = message?;
                check_tagged(&message)?;
                by_sender.entry(message.sender).or_default().push(message.seq);
            }
            Ok(by_sender)
        })??;
    peer.expect("done")?;
    peer.finish()?;
    ensure!(got.len() == 100, "messages from {} of 100 senders", got.len());
    for (sender, seqs) in got {
        ensure!(seqs == [0, 1, 2, 3], "sender {sender}: {seqs:?}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Peers killed at the worst moment.

/// A producer whose `main` returns right after its last `send`, before the receiver read
/// anything: every message arrives, exact, then the end.
fn sender_exits_right_after_sending() -> Result<()> {
    let _memory = shared_memory_use();
    let (mut receiver, mut peer) = many_from("send-many", "om-exits", 4, &["--exit"])?;
    peer.expect("sent")?;
    for id in 0..4 {
        let message = receiver
            .recv_timeout(BOUND)
            .with_context(|| format!("message {id} of a sender that returned from main"))?;
        ensure!(message.id == id, "message {} where {id} was due", message.id);
        check_many(&message, true)?;
    }
    ensure!(peer.wait_exit()?.success(), "the sender's program failed");
    expect_end(&mut receiver, "the sender's end")?;
    let errors = receiver.take_errors();
    ensure!(errors.is_empty(), "a sender that exited cleanly: {errors:?}");
    Ok(())
}

/// Killed once `send` has returned for every message and their bytes are in the socket, before
/// the receiver looked: every message arrives, exact, then the end.
fn sender_killed_before_look() -> Result<()> {
    let _memory = shared_memory_use();
    let (mut receiver, mut peer) = many_from("send-many", "om-killed-written", 1, &[])?;
    peer.expect("sent")?;
    peer.expect("written")?; // every byte is in the socket; the receiver has not looked yet
    peer.kill()?;
    let message = receiver.recv_timeout(BOUND).context("the message of a sender killed after writing it")?;
    ensure!(message.id == 0, "message {} where 0 was due", message.id);
    check_many(&message, true)?;
    expect_end(&mut receiver, "the killed sender's message")?;
    let errors = receiver.take_errors();
    ensure!(!errors.iter().any(is_lost_message), "a message was reported lost though it arrived: {errors:?}");
    Ok(())
}

/// Killed as soon as `send` has returned for four large messages, their bytes perhaps still
/// queued in the sender: what arrives is a prefix, each message exact, then the end; a message cut
/// short is reported (`ConnectionClosed` caused by `Unfinished`), never delivered.
fn sender_killed_right_after_send_returned() -> Result<()> {
    let _memory = shared_memory_use();
    let (mut receiver, mut peer) = many_from("send-many", "om-killed-sent", 4, &[])?;
    peer.expect("sent")?;
    peer.kill()?;
    let mut arrived = 0;
    loop {
        match receiver.recv_timeout(BOUND) {
            Ok(message) => {
                ensure!(message.id == arrived, "message {} where {arrived} was due", message.id);
                check_many(&message, true)?;
                arrived += 1;
            }
            Err(Error::Disconnected) => break,
            Err(other) => bail!("after {arrived} messages of a killed sender: {other:?}"),
        }
    }
    ensure!(arrived <= 4, "{arrived} messages of 4");
    // A message cut short is reported, once, as lost; nothing else is reported. (A kill between
    // two messages leaves nothing for the receiver to see, so a report is not required.)
    let errors = receiver.take_errors();
    eprintln!("{arrived} of 4 messages arrived before the killed sender's end; reported: {errors:?}");
    ensure!(errors.iter().all(is_lost_message) && errors.len() <= 1, "after {arrived} of 4 messages: {errors:?}");
    ensure!(arrived < 4 || errors.is_empty(), "every message arrived, yet one was reported lost: {errors:?}");
    Ok(())
}

/// A receiver for `Many` messages from one sender (its socket named by `tag`), and that sender:
/// the peer's `program` (`send-many` or `send-many-gpu`) sending `count` messages, with `extra`
/// arguments.
fn many_from(program: &str, tag: &str, count: u32, extra: &[&str]) -> Result<(Receiver<Many>, Peer)> {
    let path = socket_path(tag);
    let mut receiver = Receiver::<Many>::bind(&path)?;
    receiver.expect_senders(1);
    let (path, count) = (path.to_str().context("socket path")?, count.to_string());
    let args: Vec<&str> = ["--to", path, "--count", &count].into_iter().chain(extra.iter().copied()).collect();
    Ok((receiver, Peer::start(program, &args, &[])?))
}

/// `recv` says the sender has gone (within `BOUND`), `after` what.
fn expect_end(receiver: &mut Receiver<Many>, after: &str) -> Result<()> {
    match receiver.recv_timeout(BOUND) {
        Err(Error::Disconnected) => Ok(()),
        other => bail!("after {after}: {:?}", other.map(|m| m.id)),
    }
}

/// Whether `error` reports a message lost with its sender.
fn is_lost_message(error: &Error) -> bool {
    matches!(error, Error::ConnectionClosed { cause, .. } if matches!(**cause, Error::Unfinished { .. }))
}

fn sender_killed_before_sending_anything() -> Result<()> {
    let (mut receiver, mut peer) = many_from("send-many", "om-killed-silent", 0, &[])?;
    peer.expect("sent")?; // connected, nothing sent
    peer.kill()?;
    expect_end(&mut receiver, "a sender killed before sending")
}

fn receiver_killed_while_a_send_waits() -> Result<()> {
    let _memory = shared_memory_use();
    let (peer, sender) = Peer::spawn::<Held>("reader", &["--capacity", "2"])?;
    peer.expect("ready")?;
    kill_receiver_under_a_waiting_send(peer, sender).context("over a Unix socket")?;
    let peer =
        Peer::start("reader", &["--capacity", "2", "--at", "tcp://127.0.0.1:0"], &[(tensor_queue::SECRET_ENV, KEY)])?;
    let line = peer.line()?;
    let endpoint = line.strip_prefix("ready ").with_context(|| format!("the reader said {line:?}"))?;
    let sender = Sender::<Held>::builder().secret(Secret::from_bytes(KEY)?).connect(endpoint)?;
    kill_receiver_under_a_waiting_send(peer, sender).context("over TCP")
}

/// Fills the credits of `peer` (a reader that does not read), starts a send that waits for one,
/// and kills the reader: the send ends with `Disconnected` and nothing stays leased.
fn kill_receiver_under_a_waiting_send(mut peer: Peer, sender: Sender<Held>) -> Result<()> {
    sender.wait_ready(BOUND)?;
    for id in 1..=2 {
        sender.send_timeout(&held(id)?, BOUND)?; // sent, never read
    }
    // No credit left: this send waits until the receiver is killed under it.
    let waiting = {
        let sender = sender.clone();
        thread::spawn(move || sender.send(&held(3).expect("message 3")))
    };
    thread::sleep(Duration::from_millis(100)); // not a bound: only a likelier moment to kill
    peer.kill()?;
    let result = within(BOUND, "a send waiting for credits when its receiver was killed", move || waiting.join())?;
    match result {
        Ok(Err(Error::Disconnected)) => {}
        Ok(other) => bail!("the waiting send: {other:?}"),
        Err(_) => bail!("the waiting send panicked"),
    }
    ensure!(
        sender.wait_released(BOUND),
        "{} leases outstanding after the receiver was killed",
        sender.outstanding_leases()
    );
    Ok(())
}

fn sender_killed_while_held() -> Result<()> {
    let _memory = shared_memory_use();
    let (mut receiver, mut peer) = many_from("send-many", "om-killed-held", 3, &[])?;
    let mut holding = Vec::new();
    for _ in 0..3 {
        holding.push(receiver.recv_timeout(BOUND)?);
    }
    peer.expect("sent")?;
    peer.kill()?;
    // The sender is gone; what it sent is still here, byte for byte.
    for message in &holding {
        check_many(message, true)?;
    }
    expect_end(&mut receiver, "the killed sender")?;
    for message in &holding {
        check_many(message, true)?;
    }
    drop(holding);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// A receiver that stops reading; tiny capacity, many messages.

fn receiver_stops_reading() -> Result<()> {
    let _memory = shared_memory_use();
    let (mut peer, sender) = Peer::spawn::<Held>("reader", &["--capacity", "3"])?;
    peer.expect("ready")?;
    sender.wait_ready(BOUND)?;
    for id in 1..=3 {
        sender.send_timeout(&held(id)?, BOUND)?;
    }
    // Credits exhausted: typed refusals, nothing sent.
    no_credit_left(&sender, &[100, 101], 102, "")?;
    peer.write("read 2")?;
    peer.expect("got 1 2")?;
    // Room again: sends go on where they left off.
    for id in 4..=5 {
        sender.send_timeout(&held(id)?, BOUND).with_context(|| format!("send {id} after the receiver read"))?;
    }
    peer.write("read 3")?;
    peer.expect("got 3 4 5")?;
    ensure!(sender.wait_released(BOUND), "the reader dropped everything it read");
    drop(sender);
    peer.finish()
}

/// With no credit left, `send_timeout` of each of `timed` times out and `try_send` of `tried` is
/// `Full`: typed refusals, nothing sent. `over` names the channel in the messages.
fn no_credit_left(sender: &Sender<Held>, timed: &[u64], tried: u64, over: &str) -> Result<()> {
    for &id in timed {
        match sender.send_timeout(&held(id)?, Duration::from_millis(100)) {
            Err(Error::Timeout) => {}
            other => bail!("send_timeout{over} with no credit: {other:?}"),
        }
    }
    match sender.try_send(&held(tried)?) {
        Err(Error::Full) => Ok(()),
        other => bail!("try_send{over} with no credit: {other:?}"),
    }
}

fn tcp_receiver_stops_reading() -> Result<()> {
    let _memory = shared_memory_use();
    let mut peer =
        Peer::start("reader", &["--capacity", "2", "--at", "tcp://127.0.0.1:0"], &[(tensor_queue::SECRET_ENV, KEY)])?;
    let line = peer.line()?;
    let endpoint = line.strip_prefix("ready ").with_context(|| format!("the reader said {line:?}"))?;
    let sender = Sender::<Held>::builder().secret(Secret::from_bytes(KEY)?).connect(endpoint)?;
    sender.wait_ready(BOUND)?;
    for id in 1..=2 {
        sender.send_timeout(&held(id)?, BOUND)?;
    }
    no_credit_left(&sender, &[100], 101, " over TCP")?;
    peer.write("read 1")?;
    peer.expect("got 1")?;
    sender.send_timeout(&held(3)?, BOUND).context("send after the TCP receiver read")?;
    peer.write("read 2")?;
    peer.expect("got 2 3")?;
    drop(sender);
    peer.finish()
}

fn tiny_capacity_many_messages() -> Result<()> {
    let _memory = shared_memory_use();
    const COUNT: u64 = 3000;
    let path = socket_path("om-flood");
    let mut receiver = Receiver::<(u64, Option<Tensor>)>::builder().capacity(1).bind(&path)?;
    receiver.expect_senders(1);
    let path_text = path.to_str().context("socket path")?.to_string();
    let peer = Peer::start("flood", &["--to", &path_text, "--count", &COUNT.to_string()], &[])?;
    let got = within(Duration::from_secs(60), "receiving 3,000 messages at capacity 1", move || -> Result<u64> {
        let mut next = 0;
        for message in receiver.iter() {
            let (i, tensor) = message?;
            ensure!(i == next, "message {i} where {next} was due");
            match tensor {
                Some(t) => ensure!(i % 10 == 0 && t.to_vec::<i64>()? == [i as i64; 4], "message {i}'s tensor"),
                None => ensure!(i % 10 != 0, "message {i} lost its tensor"),
            }
            next += 1;
        }
        Ok(next)
    })??;
    ensure!(got == COUNT, "{got} of {COUNT} messages");
    peer.expect("done")?;
    peer.finish()
}

// ---------------------------------------------------------------------------------------------
// TCP.

const KEY: &str = "outside-messages-shared-secret-0123456789";

fn tcp_many_tensors_and_odd_sizes() -> Result<()> {
    let _memory = shared_memory_use();
    let mut receiver = Receiver::<OverTcp>::builder().secret(Secret::from_bytes(KEY)?).bind("tcp://127.0.0.1:0")?;
    let endpoint = format!("tcp://{}", receiver.local_addr().context("bound to TCP")?);
    let peer = Peer::start("tcp-send", &["--to", &endpoint, "--count", "2"], &[(tensor_queue::SECRET_ENV, KEY)])?;
    for id in 0..2 {
        let message = receiver.recv_timeout(BOUND)?;
        ensure!(message.many.id == id, "message {} where {id} was due", message.many.id);
        check_over_tcp(&message)?;
        ensure!(message.odd.iter().all(|t| t.path() == TransferPath::Tcp), "a host tensor over TCP came another way");
    }
    peer.expect("sent")?;
    peer.finish()
}

fn tcp_wrong_secret() -> Result<()> {
    let _memory = shared_memory_use();
    let mut receiver = Receiver::<OverTcp>::builder().secret(Secret::from_bytes(KEY)?).bind("tcp://127.0.0.1:0")?;
    let endpoint = format!("tcp://{}", receiver.local_addr().context("bound to TCP")?);
    let wrong = Secret::from_bytes("not-the-secret-the-receiver-holds")?;
    let attempt = {
        let endpoint = endpoint.clone();
        within(BOUND, "connect with a wrong secret", move || {
            Sender::<OverTcp>::builder()
                .secret(wrong)
                .timeout(Duration::from_secs(10))
                .connect(endpoint.as_str())
                .map(|_| ())
        })?
    };
    match attempt {
        Err(Error::Core(ipc_core::Error::AuthFailed { .. })) => {}
        other => bail!("a wrong secret: {other:?}"),
    }
    // A separate program with the wrong secret in TQ_SECRET fails the same way.
    let mut impostor = Peer::start(
        "tcp-send",
        &["--to", &endpoint, "--count", "1"],
        &[(tensor_queue::SECRET_ENV, "another-wrong-secret-of-length")],
    )?;
    let line = impostor.lines.recv_timeout(BOUND).context("the impostor said nothing")?;
    ensure!(line.starts_with("error Core(AuthFailed"), "the impostor: {line}");
    ensure!(!impostor.wait_exit()?.success(), "the impostor exited successfully");
    // The receiver reports the refusals, and an honest sender goes on.
    let honest = Peer::start("tcp-send", &["--to", &endpoint, "--count", "1"], &[(tensor_queue::SECRET_ENV, KEY)])?;
    let message = receiver.recv_timeout(BOUND)?;
    check_over_tcp(&message)?;
    honest.expect("sent")?;
    honest.finish()?;
    let errors = receiver.take_errors();
    ensure!(
        errors.iter().any(|e| format!("{e:?}").contains("AuthFailed")),
        "take_errors after two wrong secrets: {errors:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// GPU variants.

fn gpu_stream() -> Result<Stream> {
    Ok(Stream::new(&Context::on_ordinal(0)?)?)
}

fn gpu_many_tensors_to_a_child() -> Result<()> {
    let _memory = shared_memory_use();
    let stream = gpu_stream()?;
    let (peer, sender) = Peer::spawn::<Many>("recv-many", &[])?;
    for id in 0..3 {
        sender.send_on(&many(id, Some(&stream))?, &stream)?;
    }
    for id in 0..3 {
        peer.expect(&format!("ok {id}"))?;
    }
    ensure!(sender.wait_released(BOUND), "the child still holds GPU tensors after checking them");
    drop(sender);
    peer.expect("done 3")?;
    peer.finish()
}

fn gpu_consumer_holds_many() -> Result<()> {
    let _memory = exclusive_memory_use();
    let before = memory::usage();
    let stream = gpu_stream()?;
    let (mut peer, sender) = Peer::spawn::<Many>("hold-many", &["--count", "32"])?;
    for id in 0..32 {
        sender.send_on(&many(id, Some(&stream))?, &stream)?;
    }
    peer.expect("holding 32")?;
    ensure!(
        sender.outstanding_leases() == 32,
        "{} leases outstanding for 32 held messages",
        sender.outstanding_leases()
    );
    peer.write(&format!("drop {}", seed()))?;
    peer.expect("dropped")?;
    ensure!(
        sender.wait_released(BOUND),
        "{} leases outstanding after the receiver dropped all",
        sender.outstanding_leases()
    );
    stream.synchronize()?;
    memory_back_to(&before)?;
    drop(sender);
    peer.finish()
}

fn gpu_sender_killed_before_look() -> Result<()> {
    let _memory = shared_memory_use();
    let _context = Context::on_ordinal(0)?;
    let (mut receiver, mut peer) = many_from("send-many-gpu", "om-gpu-killed", 1, &[])?;
    peer.expect("written")?; // its GPU work was done and every byte written
    peer.kill()?;
    let message = receiver.recv_timeout(BOUND)?;
    ensure!(message.id == 0, "message {} where 0 was due", message.id);
    check_many(&message, true)?;
    expect_end(&mut receiver, "the killed GPU sender")
}
