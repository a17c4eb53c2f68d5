//! What users do with tensor-queue, and what attackers do to it, across real processes with host
//! tensors (no GPU needed). The second process is always `tq-user` (`tests/src/bin/tq-user.rs`),
//! started as its own program; every wait has a deadline, and every child is killed at the end.

use std::ffi::{c_char, c_int, c_uint};
use std::io::Write as _;
use std::os::fd::{AsFd, FromRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use integration_tests::queue::{Probe, checksum, probe, wait_for};
use integration_tests::raw::{hello, raw_client};
use integration_tests::talk::Talking;
use integration_tests::{bin_path, socket_path};
use ipc_core::seqpacket::{Connection, Listener};
use kernels::reference;
use tensor_queue::testing::wire::{
    ChunkKind, Descriptors, Fence, Frame, Hello, MAX_MESSAGE_BYTES, Source, StorageDesc, ToReceiver, ToSender,
};
use tensor_queue::{DType, Error, Receiver, Sender, Tensor, monotonic_ns};

/// What the `blob` role receives: an id, tensors, a byte payload and a text payload.
type Blob = (u64, Vec<Tensor>, Vec<u8>, String);

integration_tests::talking!(
    /// A running `tq-user` (its lines, its stdin, and a kill when it goes out of scope).
    User
);

impl User {
    /// Starts `tq-user <args>`.
    fn start(args: &[&str]) -> User {
        let mut command = user_command(args);
        let child = command.spawn().expect("starting tq-user");
        User::adopt(child)
    }

    /// Starts `tq-user <args>` with a channel to it ([`tensor_queue::spawn`]).
    fn spawn<T: serde::Serialize>(args: &[&str]) -> (User, Sender<T>) {
        let mut command = user_command(args);
        let (child, sender) = tensor_queue::spawn::<T>(&mut command).expect("spawning tq-user");
        (User::adopt(child), sender)
    }

    fn adopt(child: Child) -> User {
        let tag = format!("tq-user {}", child.id());
        User(Talking::adopt("tq-user", child, tag))
    }
}

fn user_command(args: &[&str]) -> Command {
    let mut command = Command::new(bin_path("tq-user").expect("tq-user is built"));
    command.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    command
}

/// Runs `work` on a thread and gives its result within `timeout`, or `None` (the thread is left
/// behind; the test's children are killed when it ends, which frees whatever it waits for).
fn within<R: Send + 'static>(timeout: Duration, work: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(work());
    });
    rx.recv_timeout(timeout).ok()
}

/// A probe whose note marks it as coming from an honest sender.
fn honest(id: u64, seed: u64, len: usize) -> Probe {
    let mut probe = probe(id, seed, len, None).unwrap();
    probe.note = format!("honest {}", probe.note);
    probe
}

/// The serde payload tensor-queue writes for `probe` (whose tensors the payload names by index),
/// taken from a real `Sender` talking to a raw listener: raw frames can then carry a message the
/// receiver decodes, whatever the serde format is.
fn payload_of(probe: Probe) -> Vec<u8> {
    let path = socket_path("capture");
    let listener = Listener::bind(&path).unwrap();
    let sending = std::thread::spawn(move || {
        let sender = Sender::<Probe>::connect(&path).unwrap();
        sender.send(&probe).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let connection = listener.accept(Some(Duration::from_secs(10))).unwrap();
    connection.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = vec![0u8; 64 << 20];
    connection.recv(&mut buf).unwrap();
    connection.send(&hello(4, 0x7e57).encode(), &[]).unwrap();
    loop {
        let (n, _fds) = connection.recv(&mut buf).unwrap();
        assert!(n > 0, "the capturing sender hung up");
        if let Ok(ToReceiver::Message { payload, .. }) = ToReceiver::decode(&buf[..n]) {
            sending.join().unwrap();
            return payload;
        }
    }
}

/// A descriptor table of one tensor: `len` bytes at the start of chunk `chunk`, viewed as
/// `shape`/`strides` of `dtype`.
fn desc(chunk: u64, len: u64, dtype: DType, view_offset: u64, shape: &[u64], strides: &[i64]) -> Descriptors {
    let mut table = Descriptors::default();
    let source = Source::SameDevice { chunk, offset: 0 };
    let storage = table.push_storage(StorageDesc { source, len, fence: Fence::None });
    table.push_tensor(storage, view_offset, dtype, shape, strides);
    table
}

fn message(seq: u64, tensors: Descriptors, payload: &[u8]) -> Vec<u8> {
    ToReceiver::Message { seq, sent_ns: monotonic_ns(), encoded_ns: monotonic_ns(), tensors, payload: payload.to_vec() }
        .encode()
}

fn announce(id: u64, len: u64) -> Vec<u8> {
    ToReceiver::Chunk { id, len, kind: ChunkKind::Host, device: [0; 16], legacy: None, writable: false }.encode()
}

const MFD_CLOEXEC: c_uint = 1;
const MFD_ALLOW_SEALING: c_uint = 2;
const F_ADD_SEALS: c_int = 1033;
const F_SEAL_SHRINK: c_int = 2;
const F_SEAL_GROW: c_int = 4;

unsafe extern "C" {
    fn memfd_create(name: *const c_char, flags: c_uint) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
}

/// A memfd of `len` bytes holding `pattern(len, seed)`; `sealed`: it can neither shrink nor grow.
fn memfd(len: usize, seed: u64, sealed: bool) -> std::fs::File {
    // SAFETY: the name is a NUL-terminated string; the flags are valid.
    let fd = unsafe { memfd_create(c"tq-user-attack".as_ptr(), MFD_CLOEXEC | MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let mut file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.write_all(&reference::pattern(len, seed)).unwrap();
    if sealed {
        // SAFETY: `fd` is an open memfd made with MFD_ALLOW_SEALING; F_ADD_SEALS takes an int.
        let rc = unsafe { fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) };
        assert_eq!(rc, 0, "F_ADD_SEALS: {}", std::io::Error::last_os_error());
    }
    file
}

/// A raw client with one host chunk (id 1) of `len` bytes holding `pattern(len, seed)` in a sealed
/// memfd: what an honest sender would announce.
fn raw_client_with_chunk(path: &Path, len: usize, seed: u64) -> Connection {
    let connection = raw_client(path);
    let file = memfd(len, seed, true);
    connection.send(&announce(1, len as u64), &[file.as_fd()]).unwrap();
    connection
}

/// The `Error` variant's name, for checks that must compile before the variant exists.
fn variant(error: &Error) -> String {
    let debug = format!("{error:?}");
    debug.split(['(', ' ', '{']).next().unwrap_or_default().to_string()
}

/// Eight threads of one process, each with its own `Sender`, feed one receiver in another
/// process: 4000 fresh tensors arrive, each byte checked.
#[test]
fn eight_threads_with_their_own_senders_feed_one_receiver() {
    let path = socket_path("eight");
    let path_arg = path.to_str().unwrap();
    let mut receiver = User::start(&["serve", "--listen", path_arg, "--expect", "4000", "--deadline-s", "90"]);
    receiver.expect("ready", Duration::from_secs(20));
    let (done_tx, done) = mpsc::channel();
    for thread in 0..8u64 {
        let (path, done_tx) = (path.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let result = (|| -> tensor_queue::Result<()> {
                let sender = Sender::<Probe>::connect(&path)?;
                for i in 0..500u64 {
                    let len = 64 + (i as usize * 37) % 2000;
                    sender.send(&honest(thread * 500 + i, (thread << 32) | i, len))?;
                }
                Ok(())
            })();
            let _ = done_tx.send((thread, result.map_err(|e| format!("{e:?}"))));
        });
    }
    for _ in 0..8 {
        let (thread, result) = done.recv_timeout(Duration::from_secs(90)).expect("a sending thread is stuck");
        assert!(result.is_ok(), "thread {thread}: {result:?}");
    }
    let line = receiver.expect_any(&["done", "timeout"], Duration::from_secs(90));
    assert_eq!(line, "done honest=4000 distinct=4000 bad=0");
    assert!(receiver.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

/// A pipeline stage forwards a tensor it received to the next stage: refused with
/// `Error::NotSendable` (forwarding needs a copy), nothing leaks, and no wrong bytes ever arrive.
#[test]
fn forwarding_a_received_tensor_is_refused_and_leaks_nothing() {
    let path_c = socket_path("stage-c");
    let mut stage_c = Receiver::<Probe>::bind(&path_c).unwrap();
    let (mut stage_b, to_b) = User::spawn::<Probe>(&["forward", "--to", path_c.to_str().unwrap()]);
    stage_b.expect("sent-own", Duration::from_secs(20));
    // B's own tensor reached C: B has announced a chunk of its own on that connection.
    let own = stage_c.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(checksum(&own.tensors[0]).unwrap(), own.expected[0]);
    to_b.send(&probe(9, 4242, 4096, None).unwrap()).unwrap();
    let outcome = stage_b.expect("forward:", Duration::from_secs(20));
    // Whatever arrives at C must hold the right bytes.
    let mut wrong = Vec::new();
    let mut arrived = Vec::new();
    while let Ok(message) = stage_c.recv_timeout(Duration::from_millis(500)) {
        for (i, (tensor, expected)) in message.tensors.iter().zip(&message.expected).enumerate() {
            if checksum(tensor).ok() != Some(*expected) {
                wrong.push(format!("message {} tensor {i}", message.id));
            }
        }
        arrived.push(message.id);
    }
    drop(own);
    let leases = stage_b.expect("leases", Duration::from_secs(20));
    assert!(wrong.is_empty(), "wrong bytes reached C: {wrong:?} ({outcome})");
    assert!(outcome.starts_with("forward: err NotSendable"), "{outcome}; C got {arrived:?}");
    assert!(arrived.is_empty(), "C got {arrived:?}");
    assert!(leases.starts_with("leases 0 "), "B leaked a lease: {leases}");
    drop(to_b);
}

/// A consumer gathers a batch of 300 (then 1000) small messages and drops them together: both
/// sides finish within seconds and every lease comes back.
#[test]
fn a_consumer_that_drops_a_large_batch_at_once_returns_every_lease() {
    for count in [300usize, 1000] {
        let count_arg = count.to_string();
        let (mut consumer, sender) = User::spawn::<Probe>(&["collect", "--count", &count_arg]);
        let sender = Arc::new(sender);
        let feeder = sender.clone();
        let sent = within(Duration::from_secs(30), move || {
            (0..count as u64).try_for_each(|i| feeder.send(&honest(i, 1000 + i, 100 + i as usize % 300)))
        });
        assert!(matches!(sent, Some(Ok(()))), "sending {count}: {:?}", sent.map(|r| r.map_err(|e| e.to_string())));
        consumer.expect("collected", Duration::from_secs(30));
        let dropped = consumer.expect("dropped", Duration::from_secs(10));
        let returned = sender.wait_released(Duration::from_secs(10));
        assert!(returned, "{count}: {} leases still out 10 s after {dropped}", sender.outstanding_leases());
        drop(sender);
        consumer.expect("disconnected", Duration::from_secs(10));
        assert!(consumer.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()), "{count}");
        assert!(!consumer.drain().iter().any(|l| l.starts_with("bad")), "{:?}", consumer.seen());
    }
}

/// A receiver that closes one connection for a malformed frame keeps what it holds from an honest
/// sender: the held tensors still read right after the honest sender sent much more through the
/// same memory pool.
#[test]
fn closing_a_bad_connection_keeps_what_an_honest_sender_lent() {
    let path = socket_path("keep");
    let path_arg = path.to_str().unwrap();
    let mut receiver = User::start(&["serve", "--listen", path_arg, "--expect", "304", "--hold", "4"]);
    receiver.expect("ready", Duration::from_secs(20));
    let sender = Sender::<Probe>::connect(&path).unwrap();
    for id in 0..4 {
        sender.send(&honest(id, 50 + id, 8192)).unwrap();
    }
    assert!(wait_for(Duration::from_secs(10), || sender.outstanding_leases() == 4).is_some(), "four held");
    let garbage = raw_client(&path);
    garbage.send(b"TQF1 this is not a frame", &[]).unwrap();
    receiver.expect("error:", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(sender.outstanding_leases(), 4, "the receiver still holds the honest sender's four tensors");
    for id in 4..304 {
        sender.send(&honest(id, 50 + id, 8192)).unwrap();
    }
    let held = receiver.expect_any(&["held", "timeout"], Duration::from_secs(60));
    assert_eq!(held, "held ok 4", "held tensors changed under the receiver");
    let done = receiver.expect("done", Duration::from_secs(10));
    assert_eq!(done, "done honest=304 distinct=304 bad=0");
}

/// Dropping a `Receiver` while still holding one of its tensors wakes a sender blocked on a full
/// queue with `Error::Disconnected`; the held tensor's lease comes back only when it is dropped,
/// or when its process exits.
#[test]
fn dropping_a_receiver_wakes_a_blocked_sender_and_held_leases_come_back_later() {
    for ending in ["drop-tensor", "exit"] {
        let (mut user, sender) = User::spawn::<Probe>(&["drop-receiver"]);
        let sender = Arc::new(sender);
        sender.send(&honest(0, 1, 4096)).unwrap();
        user.expect("holding", Duration::from_secs(20));
        let (results_tx, results) = mpsc::channel();
        let feeder = sender.clone();
        std::thread::spawn(move || {
            for id in 1..3 {
                let result = feeder.send(&honest(id, 1 + id, 4096));
                let _ = results_tx.send((id, result.map_err(|e| variant(&e))));
            }
        });
        let second = results.recv_timeout(Duration::from_secs(10)).expect("the second send fits the queue");
        assert_eq!(second, (1, Ok(())));
        assert!(results.recv_timeout(Duration::from_millis(300)).is_err(), "a third send went through a full queue");
        let start = Instant::now();
        assert!(sender.is_connected());
        let _ = sender.outstanding_leases();
        assert!(start.elapsed() < Duration::from_millis(10), "queries blocked behind a blocked send");
        user.tell("drop-receiver");
        user.expect("receiver-dropped", Duration::from_secs(10));
        let third = results.recv_timeout(Duration::from_secs(1));
        assert_eq!(third, Ok((2, Err("Disconnected".to_string()))), "the blocked send after the receiver dropped");
        assert!(!sender.is_connected(), "is_connected after the receiver dropped");
        // The held tensor's lease stays out (the unreceived second message's may too, until the
        // connection closes).
        std::thread::sleep(Duration::from_millis(200));
        let while_held = sender.outstanding_leases();
        user.tell(ending);
        let back = wait_for(Duration::from_secs(1), || sender.outstanding_leases() == 0);
        assert!(
            (1..=2).contains(&while_held) && back.is_some(),
            "{ending}: leases out while one tensor is held: {while_held} (expected 1 or 2); \
             1 s after `{ending}`: {}",
            sender.outstanding_leases()
        );
    }
}

/// A peer that connects and never reads what the receiver writes to it does not stop the
/// receiver from serving an honest sender 2000 messages.
#[test]
fn a_peer_that_never_reads_does_not_stall_an_honest_sender() {
    let path = socket_path("no-reader");
    let path_arg = path.to_str().unwrap();
    let mut receiver =
        User::start(&["serve", "--listen", path_arg, "--capacity", "4096", "--expect", "2000", "--quiet"]);
    receiver.expect("ready", Duration::from_secs(20));
    // Within its 4096 credits, each message with one tensor: the receiver owes it a credit and a
    // release per message, and writes them to a socket nobody reads.
    let expected = vec![reference::checksum(&reference::pattern(1 << 16, 3)[..64])];
    let payload = payload_of(Probe {
        id: 1,
        tensors: vec![Tensor::zeros(DType::U8, &[64]).unwrap()],
        expected,
        note: "raw".into(),
    });
    let sent_raw = Arc::new(AtomicUsize::new(0));
    let counter = sent_raw.clone();
    let raw_path = path.clone();
    std::thread::spawn(move || {
        let connection = raw_client_with_chunk(&raw_path, 1 << 16, 3);
        for seq in 1..=4000u64 {
            let tensor = desc(1, 64, DType::U8, 0, &[64], &[1]);
            if connection.send(&message(seq, tensor, &payload), &[]).is_err() {
                break;
            }
            counter.fetch_add(1, Ordering::SeqCst);
        }
        // Stay connected, never reading.
        std::thread::sleep(Duration::from_secs(120));
        drop(connection);
    });
    let raw_done = wait_for(Duration::from_secs(10), || sent_raw.load(Ordering::SeqCst) == 4000);
    eprintln!("raw peer sent {} messages (all: {raw_done:?})", sent_raw.load(Ordering::SeqCst));
    let honest_path = path.clone();
    let sent = within(Duration::from_secs(60), move || {
        let sender = Sender::<Probe>::connect(&honest_path)?;
        (0..2000u64).try_for_each(|i| sender.send(&honest(i, 7 + i, 256)))
    });
    assert!(matches!(sent, Some(Ok(()))), "the honest sender: {:?}", sent.map(|r| r.map_err(|e| e.to_string())));
    let line = receiver.expect_any(&["done", "timeout"], Duration::from_secs(60));
    assert_eq!(line, "done honest=2000 distinct=2000 bad=0");
}

/// A hostile receiver takes two messages fairly, then grants `u32::MAX` credits over and over and
/// never releases: the sender neither stalls nor panics (its sends go through or fail with a typed
/// error), and its queries answer at once while it sends (within 10 ms, with 1%
/// of calls allowed up to 100 ms for a loaded machine's scheduler).
#[test]
fn a_receiver_granting_absurd_credit_does_not_stall_the_sender() {
    let path = socket_path("hostile-receiver");
    let mut hostile = User::start(&["hostile", "--listen", path.to_str().unwrap()]);
    hostile.expect("ready", Duration::from_secs(20));
    let sender = Arc::new(Sender::<Probe>::connect(&path).unwrap());
    let feeder = sender.clone();
    let sending = Arc::new(AtomicBool::new(true));
    let still_sending = sending.clone();
    let (results_tx, results) = mpsc::channel();
    std::thread::spawn(move || {
        for id in 0..200u64 {
            let result = feeder.send(&honest(id, id, 1024)).map_err(|e| variant(&e));
            let failed = result.is_err();
            let _ = results_tx.send(result);
            if failed {
                break;
            }
        }
        still_sending.store(false, Ordering::SeqCst);
    });
    // The queries run on a thread of their own, so that one that blocks cannot hang the test.
    let (probe_tx, probes) = mpsc::channel();
    let (prober, probing) = (sender.clone(), sending.clone());
    std::thread::spawn(move || {
        while probing.load(Ordering::SeqCst) {
            let start = Instant::now();
            let _ = prober.outstanding_leases();
            let leases = start.elapsed();
            let start = Instant::now();
            let _ = prober.is_connected();
            if probe_tx.send(leases.max(start.elapsed())).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    let mut took = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sending.load(Ordering::SeqCst) && Instant::now() < deadline {
        match probes.recv_timeout(Duration::from_secs(1)) {
            Ok(duration) => took.push(duration),
            Err(_) if !sending.load(Ordering::SeqCst) => break,
            Err(_) => panic!("outstanding_leases() or is_connected() blocked for over 1 s while sending"),
        }
    }
    let outcomes: Vec<Result<(), String>> = results.try_iter().collect();
    assert!(!sending.load(Ordering::SeqCst), "200 sends did not finish in 20 s: {} done", outcomes.len());
    took.sort();
    let slow = took.iter().filter(|d| **d > Duration::from_millis(10)).count();
    assert!(took.last().is_none_or(|d| *d < Duration::from_millis(100)), "a query took {:?}", took.last());
    assert!(slow * 100 <= took.len(), "{slow} of {} queries took over 10 ms", took.len());
    let oks = outcomes.iter().filter(|r| r.is_ok()).count();
    eprintln!("{oks} sends went through; the last: {:?}", outcomes.last());
    assert!(oks >= 2, "the two fair messages: {outcomes:?}");
    hostile.expect("credited", Duration::from_secs(10));
    assert!(oks == 200 || outcomes.last().is_some_and(|r| r.is_err()), "{outcomes:?}");
    if let Some(Err(kind)) = outcomes.last() {
        assert!(!kind.is_empty() && kind != "Core", "an untyped error after {oks} sends: {kind}");
    }
    assert!(hostile.alive(), "the hostile receiver is still there");
}

/// Gathers what `user` says (but `ready`) into `said` until `until` holds of it, the user dies, or
/// 5 s pass.
fn listen(user: &mut User, said: &mut Vec<String>, until: &dyn Fn(&[String]) -> bool) {
    wait_for(Duration::from_secs(5), || {
        said.extend(user.drain().iter().filter(|l| !l.starts_with("ready")).cloned());
        user.clear_seen();
        until(said) || !user.alive()
    });
}

/// A raw sender announces a host chunk in an unsealed memfd (and another in a regular file), sends
/// a message on it, then shrinks the file and sends another: the receiver refuses such a chunk
/// (errors in `take_errors`; no SIGBUS can reach its user), stays alive, and an honest sender
/// beside it loses nothing.
#[test]
fn a_chunk_that_can_shrink_is_refused_without_sigbus() {
    let path = socket_path("sigbus");
    let path_arg = path.to_str().unwrap();
    let mut receiver = User::start(&["serve", "--listen", path_arg, "--expect", "100"]);
    receiver.expect("ready", Duration::from_secs(20));
    let sender = Sender::<Probe>::connect(&path).unwrap();
    for id in 0..50 {
        sender.send(&honest(id, 900 + id, 4096)).unwrap();
    }
    let len = 1 << 16;
    let payload = |id| {
        let mut probe = probe(id, 31, len, None).unwrap();
        probe.note = "raw-shrinkable".into();
        payload_of(probe)
    };
    let (first, second) = (payload(1), payload(2));
    let regular_path = std::env::temp_dir().join(format!("tq-reliability-{}-regular", std::process::id()));
    let regular = std::fs::File::options().read(true).write(true).create(true).truncate(true).open(&regular_path);
    let mut regular = regular.unwrap();
    regular.write_all(&reference::pattern(len, 31)).unwrap();
    std::fs::remove_file(&regular_path).unwrap();
    let mut said: Vec<String> = Vec::new();
    let mut attackers = Vec::new();
    for (kind, file) in [("unsealed memfd", memfd(len, 31, false)), ("regular file", regular)] {
        assert!(receiver.alive(), "the receiver died before the {kind}: {said:?}");
        let connection = raw_client(&path);
        connection.send(&announce(1, len as u64), &[file.as_fd()]).unwrap();
        let tensor = || desc(1, len as u64, DType::U8, 0, &[len as u64], &[1]);
        let _ = connection.send(&message(1, tensor(), &first), &[]);
        let errors = said.iter().filter(|l| l.starts_with("error:")).count();
        listen(&mut receiver, &mut said, &|s| {
            s.iter().filter(|l| l.starts_with("error:")).count() > errors || s.iter().any(|l| l.starts_with("other 1"))
        });
        // Delivered or not, shrink it now and use it again: a mapping of it would now fault.
        file.set_len(0).unwrap();
        let _ = connection.send(&message(2, tensor(), &second), &[]);
        listen(&mut receiver, &mut said, &|s| s.iter().any(|l| l.starts_with("other 2")));
        eprintln!("after the {kind}: {said:?}");
        attackers.push((connection, file));
    }
    let status = receiver.try_wait();
    assert!(status.is_none(), "the receiver died: {status:?} (it said {said:?})");
    assert!(!said.iter().any(|l| l.starts_with("other")), "a shrinkable chunk was used: {said:?}");
    assert!(said.iter().filter(|l| l.starts_with("error:")).count() >= 2, "both refused: {said:?}");
    for id in 50..100 {
        sender.send(&honest(id, 900 + id, 4096)).unwrap();
    }
    let done = receiver.expect_any(&["done", "timeout"], Duration::from_secs(30));
    assert_eq!(done, "done honest=100 distinct=100 bad=0");
    assert!(receiver.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

/// Hostile views (a zero-stride view of 2^60 elements over 512 bytes, an unaligned `f32` view, 40
/// dimensions) are each refused by the receiver, which stays alive and serves an honest sender;
/// a well-formed raw view on the same kind of chunk is accepted (the control). Each attack meets
/// a fresh receiver, so that each is judged on its own.
#[test]
fn hostile_views_are_refused_and_the_receiver_lives_on() {
    let control = payload_of(Probe {
        id: 77,
        tensors: vec![Tensor::from_slice(&reference::pattern(512, 5), DType::U8, &[512]).unwrap()],
        expected: vec![reference::checksum(&reference::pattern(512, 5))],
        note: "raw-control".into(),
    });
    let attack = payload_of(Probe {
        id: 66,
        tensors: vec![Tensor::zeros(DType::U8, &[4]).unwrap()],
        expected: vec![0],
        note: "raw-attack".into(),
    });
    let attacks = [
        ("zero strides, 2^60 elements", desc(1, 512, DType::U8, 0, &[1 << 60], &[0])),
        ("f32 at byte 1", desc(1, 512, DType::F32, 1, &[16], &[1])),
        ("40 dimensions", desc(1, 512, DType::U8, 0, &[1; 40], &[1; 40])),
    ];
    let mut failures = Vec::new();
    for (name, tensor) in attacks {
        let path = socket_path("views");
        let mut receiver = User::start(&["serve", "--listen", path.to_str().unwrap(), "--expect", "20"]);
        receiver.expect("ready", Duration::from_secs(20));
        let sender = Sender::<Probe>::connect(&path).unwrap();
        for id in 0..10 {
            sender.send(&honest(id, 300 + id, 2048)).unwrap();
        }
        let hostile = raw_client_with_chunk(&path, 512, 5);
        hostile.send(&message(1, tensor, &attack), &[]).unwrap();
        let control_client = raw_client_with_chunk(&path, 512, 5);
        let control_view = desc(1, 512, DType::U8, 0, &[512], &[1]);
        control_client.send(&message(1, control_view, &control), &[]).unwrap();
        let mut said = Vec::new();
        wait_for(Duration::from_secs(10), || {
            said.extend(receiver.drain().iter().filter(|l| !l.starts_with("ready")).cloned());
            receiver.clear_seen();
            let refused = said.iter().any(|l| l.starts_with("error:") || l.starts_with("recv-error"));
            (refused && said.iter().any(|l| l.contains("raw-control"))) || !receiver.alive()
        });
        if let Some(status) = receiver.try_wait() {
            failures.push(format!("{name}: the receiver died ({status}); it said {said:?}"));
            continue;
        }
        if said.iter().any(|l| l.contains("raw-attack")) {
            failures.push(format!("{name}: delivered: {said:?}"));
        }
        if !said.iter().any(|l| l.starts_with("error:") || l.starts_with("recv-error")) {
            failures.push(format!("{name}: no refusal reported: {said:?}"));
        }
        if !said.iter().any(|l| l == "other 77 raw-control ok") {
            failures.push(format!("{name}: the control was not delivered intact: {said:?}"));
        }
        for id in 10..20 {
            sender.send(&honest(id, 300 + id, 2048)).unwrap();
        }
        let done = receiver.expect_any(&["done", "timeout"], Duration::from_secs(30));
        if done != "done honest=20 distinct=20 bad=0" {
            failures.push(format!("{name}: the honest sender: {done}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Through the public API, views whose size overflows or that have too many dimensions cannot be
/// made, or if made cannot be sent: a typed `Error::Invalid`, never a panic, and never a tensor
/// whose element count wrapped around.
#[test]
fn hostile_views_cannot_be_made_or_sent_through_the_api() {
    let (mut user, sender) = User::spawn::<Probe>(&["count"]);
    let typed = |what: &str, result: std::thread::Result<tensor_queue::Result<Tensor>>| match result {
        Err(_) => Some(format!("{what}: panicked instead of returning an error")),
        Ok(Ok(tensor)) => {
            // A tensor that was made must at least know its own size (a wrapped count lets `get`
            // read far outside the storage).
            let numel = tensor.shape().iter().try_fold(1u128, |n, &d| n.checked_mul(u128::from(d)));
            if numel != Some(u128::from(tensor.numel())) {
                return Some(format!("{what}: made with numel() {} for shape {:?}", tensor.numel(), tensor.shape()));
            }
            let sent = sender.send(&Probe { id: 99, tensors: vec![tensor], expected: vec![0], note: what.into() });
            (!matches!(sent, Err(Error::Invalid(_) | Error::Tensor(_))))
                .then(|| format!("{what}: made, and sending gave {sent:?}"))
        }
        // Refused, typed: a shape that cannot exist, or a view that cannot be made.
        Ok(Err(error)) => {
            (!matches!(error, Error::Tensor(_) | Error::View { .. })).then(|| format!("{what}: {error:?}"))
        }
    };
    let unwind =
        |f: &dyn Fn() -> tensor_queue::Result<Tensor>| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let small = Tensor::zeros(DType::U8, &[512]).unwrap();
    let failures: Vec<String> = [
        typed("40 dimensions", unwind(&|| Tensor::zeros(DType::F32, &[1; 40]))),
        typed("2^96 elements", unwind(&|| Tensor::zeros(DType::U8, &[1 << 32, 1 << 32, 1 << 32]))),
        // 512 * (2^55 + 1) wraps to 512 in 64 bits.
        typed("a reshape whose size wraps", unwind(&|| small.reshape(&[(1 << 55) + 1, 512]))),
        typed("2^62 f64 elements", unwind(&|| Tensor::zeros(DType::F64, &[1 << 62]))),
    ]
    .into_iter()
    .flatten()
    .collect();
    drop(sender);
    let count = user.expect_any(&["disconnected", "recv-error"], Duration::from_secs(20));
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(count, "disconnected after 0 bad 0", "nothing was sent");
}

/// One message with 100,000 tiny host tensors and one with a 10 MB serde payload both arrive
/// intact; one over `wire::MAX_MESSAGE_BYTES` is refused with `Error::TooLarge` and the connection
/// goes on.
#[test]
fn messages_of_any_size_arrive_intact() {
    let (mut user, sender) = User::spawn::<Blob>(&["blob"]);
    let tensors: Vec<Tensor> =
        (0..100_000u64).map(|i| Tensor::from_slice(&[i as i32, !(i as i32)], DType::I32, &[2]).unwrap()).collect();
    let mut tensor_sum = 0u64;
    for tensor in &tensors {
        tensor_sum = reference::splitmix64(tensor_sum ^ checksum(tensor).unwrap());
    }
    let sent = sender.send(&(1, tensors, Vec::new(), String::new()));
    assert!(sent.is_ok(), "100,000 tensors: {sent:?}");
    let line = user.expect_any(&["blob", "recv-error"], Duration::from_secs(120));
    assert_eq!(line, format!("blob 1 100000 {tensor_sum} 0 {} 0", reference::checksum(&[])));
    let bytes = reference::pattern(10 << 20, 99);
    let sent = sender.send(&(2, Vec::new(), bytes.clone(), "x".repeat(1000)));
    assert!(sent.is_ok(), "10 MB payload: {sent:?}");
    let line = user.expect_any(&["blob", "recv-error"], Duration::from_secs(120));
    assert_eq!(line, format!("blob 2 0 0 {} {} 1000", 10 << 20, reference::checksum(&bytes)));
    drop(bytes);
    let too_large = sender.send(&(3, Vec::new(), Vec::new(), "x".repeat(MAX_MESSAGE_BYTES + 1)));
    match too_large {
        Err(Error::TooLarge { size, limit }) => assert!(limit == MAX_MESSAGE_BYTES && size > limit, "{size} {limit}"),
        other => panic!("a message over MAX_MESSAGE_BYTES: {other:?}"),
    }
    sender.send(&(4, Vec::new(), vec![1, 2, 3], "after".into())).expect("the connection goes on");
    let line = user.expect_any(&["blob", "recv-error"], Duration::from_secs(30));
    assert_eq!(line, format!("blob 4 0 0 3 {} 5", reference::checksum(&[1, 2, 3])), "nothing of message 3 arrived");
    drop(sender);
    user.expect("disconnected", Duration::from_secs(30));
}

/// Four processes race to bind one stale socket path, 50 times: there is never more than one
/// winner, a loser never removes the winner's socket, and the winner removes it when it drops.
#[test]
fn racing_binds_on_a_stale_path_have_one_winner() {
    let path: PathBuf = socket_path("race");
    let path_arg = path.to_str().unwrap().to_string();
    let mut failures = Vec::new();
    for round in 0..50u64 {
        // A stale socket file: bound, then its listener dropped without removing the file.
        let _ = std::fs::remove_file(&path);
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let at = (monotonic_ns() + 300_000_000).to_string();
        let mut racers: Vec<User> =
            (0..4).map(|_| User::start(&["bind-race", "--path", &path_arg, "--at", &at])).collect();
        let outcomes: Vec<String> =
            racers.iter_mut().map(|r| r.expect_any(&["won", "lost"], Duration::from_secs(20))).collect();
        let winners: Vec<usize> = (0..4).filter(|&i| outcomes[i] == "won").collect();
        if winners.len() != 1 {
            failures.push(format!("round {round}: {} winners: {outcomes:?}", winners.len()));
            continue;
        }
        for (i, racer) in racers.iter_mut().enumerate() {
            if i != winners[0] {
                assert!(racer.exit_within(Duration::from_secs(10)).is_some(), "round {round}: a loser stays");
            }
        }
        if !path.exists() {
            failures.push(format!("round {round}: the winner's socket file is gone"));
            continue;
        }
        let winner = &mut racers[winners[0]];
        Sender::<u64>::connect(&path).unwrap().send(&round).unwrap();
        assert_eq!(winner.expect("got", Duration::from_secs(10)), format!("got {round}"), "round {round}");
        winner.close_stdin();
        winner.expect("dropped", Duration::from_secs(10));
        assert!(winner.exit_within(Duration::from_secs(10)).is_some());
        if path.exists() {
            failures.push(format!("round {round}: the dropped receiver left its socket file"));
        }
    }
    assert!(failures.is_empty(), "{} failures: {failures:#?}", failures.len());
}

/// A receiver is killed (SIGKILL) while it holds three large host tensors: the sender's leases
/// come back within a second, and after `memory::trim()` the sender's shared memory is back to
/// its baseline. The sender is a `tq-user` of its own (its memory is not shared with other tests
/// running in this process), and the receiver another.
#[test]
fn a_killed_receiver_gives_back_leases_and_memory() {
    let mut lender = User::start(&["lender", "--count", "3", "--mib", "24"]);
    let back = lender.expect_any(&["leases", "failed"], Duration::from_secs(60));
    let millis: u64 = back
        .strip_prefix("leases back in ")
        .and_then(|r| r.strip_suffix(" ms"))
        .map_or(u64::MAX, |m| m.parse().unwrap_or(u64::MAX));
    assert!(millis <= 1000, "{back}");
    let memory = lender.expect_any(&["memory", "failed"], Duration::from_secs(20));
    let fields: Vec<&str> = memory.split(' ').collect();
    assert!(fields.len() == 4 && fields[0] == "memory", "{memory}");
    let (baseline, held, after) = (fields[1], fields[2], fields[3]);
    assert_ne!(held, baseline, "the three tensors showed in host_bytes: {memory}");
    assert_eq!(after, baseline, "host_bytes after trim (baseline, while held, after): {memory}");
    assert!(lender.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

/// `send_timeout` on a full queue gives `Error::Timeout` after about the time given, and
/// `try_send` gives `Error::Full`, without sending anything.
#[test]
fn a_full_queue_times_out_and_try_send_reports_full() {
    let (mut user, sender) = User::spawn::<u64>(&["idle", "--capacity", "2"]);
    user.expect("ready", Duration::from_secs(20));
    let filled = within(Duration::from_secs(10), move || {
        let results = [sender.send(&1).map_err(|e| variant(&e)), sender.send(&2).map_err(|e| variant(&e))];
        (sender, results)
    });
    let (sender, results) = filled.expect("two sends into a queue of two");
    assert_eq!(results, [Ok(()), Ok(())]);
    let start = Instant::now();
    let full = sender.try_send(&3);
    assert!(matches!(full, Err(Error::Full)), "try_send on a full queue: {full:?}");
    assert!(start.elapsed() < Duration::from_millis(100), "try_send waited {:?}", start.elapsed());
    let sender = Arc::new(sender);
    let timing = sender.clone();
    let timed = within(Duration::from_secs(5), move || {
        let start = Instant::now();
        let result = timing.send_timeout(&4, Duration::from_millis(300));
        (result.map_err(|e| variant(&e)), start.elapsed())
    });
    let (result, took) = timed.expect("send_timeout(300 ms) returned within 5 s");
    assert_eq!(result, Err("Timeout".to_string()));
    assert!(took >= Duration::from_millis(290) && took < Duration::from_millis(1000), "send_timeout took {took:?}");
    assert!(matches!(sender.try_send(&5), Err(Error::Full)), "still full");
    assert!(sender.is_connected());
    user.close_stdin();
    assert!(user.exit_within(Duration::from_secs(10)).is_some());
    let gone = within(Duration::from_secs(5), move || {
        sender.send_timeout(&6, Duration::from_secs(2)).map_err(|e| variant(&e))
    });
    assert_eq!(gone, Some(Err("Disconnected".to_string())), "a send to a receiver that left");
}

/// Clones of one `Sender` used from several threads, the original dropped first: the receiver
/// gets every message, and `Error::Disconnected` only after the last clone is dropped.
#[test]
fn sender_clones_on_threads_close_the_channel_when_the_last_drops() {
    let (mut user, sender) = User::spawn::<Probe>(&["count"]);
    let (done_tx, done) = mpsc::channel();
    for thread in 0..4u64 {
        let (clone, done_tx) = (sender.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let result = (0..100u64).try_for_each(|i| {
                std::thread::sleep(Duration::from_micros(thread * 300));
                clone.send(&honest(thread * 100 + i, thread * 100 + i, 512 + i as usize))
            });
            drop(clone);
            let _ = done_tx.send(result.map_err(|e| variant(&e)));
        });
    }
    drop(sender);
    for _ in 0..4 {
        let result = done.recv_timeout(Duration::from_secs(60)).expect("a sending thread is stuck");
        assert_eq!(result, Ok(()));
    }
    let line = user.expect_any(&["disconnected", "recv-error"], Duration::from_secs(30));
    assert_eq!(line, "disconnected after 400 bad 0");
}

/// Plays a receiver by hand for a real `Sender`: accepts it, reads its `Hello`, answers with one
/// of capacity 8, and returns the connection.
fn raw_receiver(path: &Path) -> (Sender<u64>, Connection) {
    let listener = Listener::bind(path).unwrap();
    let connecting = {
        let path = path.to_path_buf();
        std::thread::spawn(move || Sender::<u64>::connect(&path).unwrap())
    };
    let connection = listener.accept(Some(Duration::from_secs(10))).unwrap();
    connection.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let (n, _) = connection.recv(&mut buf).unwrap();
    assert!(Hello::decode(&buf[..n]).is_ok(), "a sender begins with Hello");
    connection.send(&hello(8, 7).encode(), &[]).unwrap();
    let sender = connecting.join().unwrap();
    sender.wait_ready(Duration::from_secs(10)).unwrap();
    (sender, connection)
}

/// A message without tensors holds no lease (issue 26: no release frame is owed for it), and a
/// receiver that releases it, or a message never sent, breaks the protocol: the sender hangs up
/// on it (its sends fail with `Disconnected`) instead of trusting what it says.
#[test]
fn a_receiver_releasing_what_it_was_not_lent_is_cut_off() {
    for lie in [vec![1u64], vec![99]] {
        let path = socket_path("lying-release");
        let (sender, connection) = raw_receiver(&path);
        sender.send(&5).unwrap();
        let mut buf = vec![0u8; 1 << 16];
        let (n, _) = connection.recv(&mut buf).unwrap();
        assert!(
            matches!(ToReceiver::decode(&buf[..n]), Ok(ToReceiver::Message { seq: 1, ref tensors, .. }) if tensors.is_empty())
        );
        assert_eq!(sender.outstanding_leases(), 0, "a message without tensors holds nothing");
        assert!(sender.wait_released(Duration::ZERO), "and needs no release");
        connection.send(&ToSender::Release { messages: lie.clone() }.encode(), &[]).unwrap();
        let hung_up = wait_for(Duration::from_secs(10), || !sender.is_connected());
        assert!(hung_up.is_some(), "the sender still trusts a receiver that released {lie:?}");
        assert!(matches!(sender.send(&6), Err(Error::Disconnected)), "released {lie:?}");
    }
}
