//! Round 6 of the outside tester's attacks, written from the README and the rustdoc of public
//! items only: how a blocked `recv` is woken and how a message of many tensors arrives.
//! Ping-pong of 20,000 round trips between two processes with random short sleeps on either side,
//! for every way a user waits (blocking, timeout, `try_recv` polling, async, `Select`, the
//! receiver's descriptor in a poll loop of one's own, spinning); senders joining, leaving and
//! being SIGKILLed while the receiver is blocked; bursts right after connect from several threads
//! of one process; messages of 1,024 and 4,096 small host tensors of every layout held at once.
//! Second processes: `outside6-peer`; shared pieces: `integration_tests::outside6`.
//!
//! Every wait is bounded: a hang is a failure that says where it stopped, never a hung CI. Every
//! bound is a generous "does not hang" bound, never a speed assertion.

use std::os::unix::process::ExitStatusExt as _;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use integration_tests::outside6::{Msg, Rng, Waiter, Way, many_tensors_differ};
use integration_tests::{bin_path, socket_path, stdout_lines};
use kernels::reference::pattern;
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

const LONG: Duration = Duration::from_secs(60);

/// Round trips of each ping-pong.
const ROUND_TRIPS: u64 = 20_000;

/// A peer process and its stdout lines; killed when dropped (a failing test leaves nothing).
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
    name: String,
}

impl Peer {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Peer {
        let mut command = Command::new(bin_path("outside6-peer").unwrap());
        command.args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().unwrap();
        let name = format!("outside6-peer {}", args.join(" "));
        let lines = stdout_lines(&mut child, Some(format!("outside6-peer {}", args[0])));
        Peer { child, lines, name }
    }

    /// The next line, within `LONG`.
    fn line(&self) -> String {
        self.lines.recv_timeout(LONG).unwrap_or_else(|_| panic!("no line from {} within {LONG:?}", self.name))
    }

    /// Waits for the line `want`, skipping others; the skipped ones are returned.
    fn until(&self, want: &str) -> Vec<String> {
        let mut skipped = Vec::new();
        loop {
            let line = self.line();
            if line == want {
                return skipped;
            }
            assert!(!line.starts_with("stuck"), "{} says {line} (its watchdog: no progress)", self.name);
            skipped.push(line);
        }
    }

    /// The next line starting with `prefix`, skipping others.
    fn until_prefix(&self, prefix: &str) -> String {
        loop {
            let line = self.line();
            if line.starts_with(prefix) {
                return line;
            }
            assert!(!line.starts_with("stuck"), "{} says {line} (its watchdog: no progress)", self.name);
        }
    }

    fn tell(&mut self, line: &str) {
        use std::io::Write as _;
        let stdin = self.child.stdin.as_mut().expect("the peer's stdin");
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Closes its stdin (the peer's cue to exit) and waits for it, within `LONG`.
    fn finish(&mut self) -> std::process::ExitStatus {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + LONG;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn path_str(path: &std::path::Path) -> &str {
    path.to_str().unwrap()
}

/// Message `index` of sender `id`: a `len`-byte pattern tensor when `index % every == 0`.
fn message(id: u32, index: u64, len: usize, every: u64) -> Msg {
    let tensors = if every != 0 && index.is_multiple_of(every) {
        vec![Tensor::from_bytes(&pattern(len, index), DType::U8, &[len as u64]).unwrap()]
    } else {
        vec![]
    };
    (id, index, tensors)
}

/// Asserts that `msg` is what `message(_, index, len, every)` made.
fn check(msg: &Msg, len: usize, every: u64) {
    let (id, index, tensors) = msg;
    let expected = every != 0 && index.is_multiple_of(every);
    assert_eq!(tensors.len(), usize::from(expected), "sender {id} message {index}: tensors");
    for tensor in tensors {
        assert!(tensor.to_bytes().unwrap() == pattern(len, *index), "sender {id} message {index}: bytes");
    }
}

/// A seed for this run, printed so that a failure can be replayed (`TQ_OUTSIDE6_SEED`).
fn seed() -> u64 {
    let seed = std::env::var("TQ_OUTSIDE6_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() as u64
    });
    eprintln!("seed {seed} (TQ_OUTSIDE6_SEED={seed} replays it)");
    seed
}

/// Runs `work` on a thread while watching `progress`: fails with `what` and where it stopped
/// when `progress` has not moved for `stuck`; `on_stuck` first (to kill a peer, so that nothing
/// is left running).
fn watched<R: Send + 'static>(
    what: &str,
    progress: &AtomicU64,
    stuck: Duration,
    mut on_stuck: impl FnMut() -> String,
    work: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(work());
    });
    let mut last = (progress.load(Ordering::Relaxed), Instant::now());
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(value) => return value,
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: the work panicked (see above)"),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let now = progress.load(Ordering::Relaxed);
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() > stuck {
            let said = on_stuck();
            panic!("{what}: no progress for {stuck:?}, stuck at {now} (a lost wake-up?); {said}");
        }
    }
}

/// Binds `path` (and `path-1` for the ways that wait on several receivers).
fn bind_for(way: Way, path: &std::path::Path, capacity: u32) -> Vec<Receiver<Msg>> {
    let mut receivers = vec![Receiver::<Msg>::builder().capacity(capacity).bind(path).unwrap()];
    if way.several() {
        let other = format!("{}-1", path_str(path));
        receivers.push(Receiver::<Msg>::builder().capacity(capacity).bind(&other).unwrap());
    }
    receivers
}

// ---------------------------------------------------------------------------------------------
// 1. Lost wake-ups: ping-pong between two processes

/// `ROUND_TRIPS` round trips with the peer process: both sides wait in `way`, each sleeps a
/// random 0-200 us half the time before answering; (0, I) goes out (to the peer's two receivers
/// in turn for the ways that wait on several), (1, I) must come back, nothing else.
fn ping_pong(way: Way, two_senders: bool) {
    ping_pong_with(way, two_senders, false, &[]);
}

/// `ping_pong`, with `window`: this side sends 1 to 6 messages (at random) before it waits for
/// their answers, so that several wait at once (a descriptor must stay readable until each is
/// taken); `env`: the peer's environment.
fn ping_pong_with(way: Way, two_senders: bool, window: bool, env: &[(&str, &str)]) {
    let seed = seed();
    let (here, there) = (socket_path("o6-pp-here"), socket_path("o6-pp-there"));
    let receivers = bind_for(way, &here, 4);
    let (count, seed_arg) = (ROUND_TRIPS.to_string(), (seed ^ 0x5eed).to_string());
    let mut args =
        vec!["pong", "--way", way.name(), "--bind", path_str(&there), "--to", path_str(&here), "--count", &count];
    args.extend(["--seed", &seed_arg, "--stuck", "50"]);
    if two_senders {
        args.push("--two-senders");
    }
    let peer = Peer::start(&args, env);
    peer.until("bound");
    let mut senders = vec![Sender::<Msg>::connect(&there).unwrap()];
    if way.several() {
        senders.push(Sender::<Msg>::connect(format!("{}-1", path_str(&there))).unwrap());
    }
    let progress = Arc::new(AtomicU64::new(0));
    let done = progress.clone();
    let peer = Arc::new(std::sync::Mutex::new(peer));
    let killer = peer.clone();
    let idle = watched(
        &format!("ping-pong ({way:?}, two senders {two_senders}, seed {seed})"),
        &progress,
        Duration::from_secs(40),
        move || {
            let mut peer = killer.lock().unwrap();
            let said: Vec<String> = peer.lines.try_iter().collect();
            peer.kill();
            format!("the peer said {said:?}")
        },
        move || {
            let mut waiter = Waiter::new(way, receivers, seed).unwrap();
            let mut rng = Rng::new(seed);
            let mut first = 0;
            while first < ROUND_TRIPS {
                let window = if window { (rng.below(6) + 1).min(ROUND_TRIPS - first) } else { 1 };
                for index in first..first + window {
                    rng.jitter();
                    // Pipelined, to the peer's first receiver only: the order across two is free.
                    let to = if window > 1 { 0 } else { (index % senders.len() as u64) as usize };
                    senders[to].send(&message(0, index, 64, 16)).unwrap();
                }
                for index in first..first + window {
                    let reply = waiter.wait().unwrap_or_else(|e| panic!("round trip {index}: {e:?}"));
                    assert_eq!((reply.0, reply.1), (1, index), "round trip {index}: the answer");
                    check(&reply, 64, 16);
                    done.store(index + 1, Ordering::Relaxed);
                }
                first += window;
            }
            waiter.idle
        },
    );
    let mut peer = peer.lock().unwrap();
    let line = peer.until_prefix("done");
    eprintln!("{way:?}: {ROUND_TRIPS} round trips; idle wake-ups here {idle}, the peer's: {line}");
    assert!(peer.finish().success());
}

#[test]
fn ping_pong_with_blocking_recv_on_both_sides_loses_no_wake_up() {
    ping_pong(Way::Block, false);
}

#[test]
fn ping_pong_with_recv_timeout_on_both_sides_loses_no_wake_up() {
    ping_pong(Way::Timeout, false);
}

#[test]
fn ping_pong_with_try_recv_polling_mixed_with_short_waits_loses_no_wake_up() {
    ping_pong(Way::Try, false);
}

#[test]
fn ping_pong_with_recv_async_on_both_sides_loses_no_wake_up() {
    ping_pong(Way::Async, false);
}

#[test]
fn ping_pong_with_select_over_two_receivers_on_both_sides_loses_no_wake_up() {
    ping_pong(Way::Select, false);
}

#[test]
fn ping_pong_with_the_receivers_descriptors_in_a_users_poll_loop_loses_no_wake_up() {
    ping_pong(Way::Poll, false);
}

#[test]
fn ping_pong_with_a_spinning_recv_loses_no_wake_up() {
    ping_pong(Way::Spin, false);
}

#[test]
fn ping_pong_with_recv_async_cancelled_over_and_over_loses_no_wake_up_and_no_message() {
    ping_pong(Way::AsyncCancel, false);
}

#[test]
fn ping_pong_answered_by_two_senders_in_turn_loses_no_wake_up() {
    // The receiver here has two senders of one process, used in turn: a fast path for a
    // receiver with one sender must not lose the other's wake-ups.
    ping_pong(Way::Block, true);
}

#[test]
fn ping_pong_over_the_socket_alone_on_the_peers_side_loses_no_wake_up() {
    // The peer's connections stay on the Unix socket (TQ_RINGS=0), this process's use rings.
    for way in [Way::Block, Way::Poll, Way::Async] {
        ping_pong_with(way, false, false, &[("TQ_RINGS", "0")]);
    }
}

#[test]
fn pipelined_ping_pong_with_up_to_six_messages_waiting_loses_no_wake_up() {
    // Several answers wait at once: poll and Select must see the descriptor readable until each
    // is taken (level-triggered, as the AsFd docs say), recv must not sleep on a queued one.
    for way in Way::ALL {
        ping_pong_with(way, false, true, &[]);
    }
}

#[test]
fn pipelined_ping_pong_over_the_socket_alone_loses_no_wake_up() {
    for way in [Way::Block, Way::Select, Way::Poll, Way::Try] {
        // One sender each way: the order across two senders' messages in flight is free.
        ping_pong_with(way, false, true, &[("TQ_RINGS", "0")]);
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Senders joining and leaving while the receiver is blocked

/// What a receiving thread saw: a message's (sender, index) or the error, in order.
type Seen = mpsc::Receiver<Result<(u32, u64), String>>;

/// A thread that waits in `way` on a receiver bound at `path` and reports each result; it
/// ends after `Disconnected`.
fn blocked_receiver(
    way: Way,
    path: &std::path::Path,
    senders: Option<usize>,
) -> (Seen, thread::JoinHandle<Vec<Error>>) {
    let mut receivers = bind_for(way, path, 16);
    if let Some(n) = senders {
        receivers[0].expect_senders(n);
    }
    // The second receiver of select / poll gets nobody: it only ends once stop_accepting says so.
    for r in receivers.iter_mut().skip(1) {
        r.stop_accepting().unwrap();
    }
    let (tx, seen) = mpsc::channel();
    let reader = thread::spawn(move || {
        let mut waiter = Waiter::new(way, receivers, 7).unwrap();
        loop {
            match waiter.wait() {
                Ok(msg) => {
                    check(&msg, 64, 1);
                    let _ = tx.send(Ok((msg.0, msg.1)));
                }
                Err(Error::Disconnected) => {
                    let _ = tx.send(Err("Disconnected".into()));
                    return waiter.receivers()[0].take_errors();
                }
                Err(other) => {
                    let _ = tx.send(Err(format!("{other:?}")));
                }
            }
        }
    });
    (seen, reader)
}

/// The receiving thread's next result, within `LONG`: a blocked recv that does not wake fails.
fn next_seen(seen: &Seen, what: &str) -> Result<(u32, u64), String> {
    seen.recv_timeout(LONG).unwrap_or_else(|_| panic!("the blocked receiver did not wake for {what} within {LONG:?}"))
}

/// Nothing arrives for a while (a spurious end or a phantom message would).
fn nothing_for_a_while(seen: &Seen, when: &str) {
    if let Ok(what) = seen.recv_timeout(Duration::from_millis(300)) {
        panic!("{when}: the receiver got {what:?}, expected to stay blocked");
    }
}

fn join_and_leave(way: Way) {
    let path = socket_path("o6-join");
    let (seen, reader) = blocked_receiver(way, &path, None);
    let p = path_str(&path);
    let mut first = Peer::start(&["manual", "--to", p, "--id", "1"], &[]);
    first.until("ready");
    nothing_for_a_while(&seen, "one sender connected, nothing sent");
    first.tell("send 0");
    assert_eq!(next_seen(&seen, "the first sender's message"), Ok((1, 0)));
    let mut second = Peer::start(&["manual", "--to", p, "--id", "2"], &[]);
    second.until("ready");
    nothing_for_a_while(&seen, "a second sender joined");
    second.tell("send 0");
    assert_eq!(next_seen(&seen, "the second sender's message"), Ok((2, 0)));
    first.tell("send 1");
    assert_eq!(next_seen(&seen, "the first sender's second message"), Ok((1, 1)));
    first.tell("exit");
    first.until("left");
    assert!(first.finish().success());
    nothing_for_a_while(&seen, "the first sender left, the second is still there");
    second.tell("send 1");
    assert_eq!(next_seen(&seen, "the remaining sender's message"), Ok((2, 1)));
    second.tell("exit");
    second.until("left");
    assert!(second.finish().success());
    assert_eq!(next_seen(&seen, "the end, once both left"), Err("Disconnected".into()));
    let errors = reader.join().unwrap();
    assert!(errors.is_empty(), "two clean goodbyes, nothing to report: {errors:?}");
}

#[test]
fn a_blocked_recv_wakes_for_each_message_and_for_the_end_as_senders_join_and_leave() {
    join_and_leave(Way::Block);
}

#[test]
fn a_blocked_recv_async_wakes_for_each_message_and_for_the_end_as_senders_join_and_leave() {
    join_and_leave(Way::Async);
}

#[test]
fn select_wakes_for_each_message_and_for_the_end_as_senders_join_and_leave() {
    join_and_leave(Way::Select);
}

#[test]
fn a_users_poll_loop_wakes_for_each_message_and_for_the_end_as_senders_join_and_leave() {
    join_and_leave(Way::Poll);
}

#[test]
fn recv_timeout_and_try_recv_see_each_message_and_the_end_as_senders_join_and_leave() {
    join_and_leave(Way::Timeout);
    join_and_leave(Way::Try);
}

/// A sender SIGKILLed while the receiver is blocked with nothing to read, beside another sender
/// that stays: the receiver must not end, and must serve the other; then the end when it leaves.
fn killed_while_blocked_with_nothing_in_flight(way: Way) {
    let path = socket_path("o6-kill-idle");
    let (seen, reader) = blocked_receiver(way, &path, Some(2));
    let p = path_str(&path);
    let mut doomed = Peer::start(&["manual", "--to", p, "--id", "1"], &[]);
    let mut stays = Peer::start(&["manual", "--to", p, "--id", "2"], &[]);
    doomed.until("ready");
    stays.until("ready");
    for i in 0..3 {
        doomed.tell(&format!("send {i}"));
        assert_eq!(next_seen(&seen, "the doomed sender's message"), Ok((1, i)));
    }
    nothing_for_a_while(&seen, "both senders quiet");
    doomed.kill(); // the receiver is blocked now
    nothing_for_a_while(&seen, "one of two senders SIGKILLed with nothing in flight");
    stays.tell("send 0");
    assert_eq!(next_seen(&seen, "the surviving sender's message"), Ok((2, 0)));
    stays.tell("exit");
    assert!(stays.finish().success());
    assert_eq!(next_seen(&seen, "the end"), Err("Disconnected".into()));
    reader.join().unwrap();
}

#[test]
fn a_sender_killed_while_recv_is_blocked_with_nothing_in_flight_leaves_the_other_served() {
    for way in [Way::Block, Way::Async, Way::Select, Way::Poll, Way::AsyncCancel] {
        killed_while_blocked_with_nothing_in_flight(way);
    }
}

#[test]
fn the_only_sender_killed_while_recv_is_blocked_wakes_it_with_the_end() {
    for way in Way::ALL {
        let path = socket_path("o6-kill-only");
        let (seen, reader) = blocked_receiver(way, &path, Some(1));
        let mut doomed = Peer::start(&["manual", "--to", path_str(&path), "--id", "1"], &[]);
        doomed.until("ready");
        doomed.tell("send 0");
        assert_eq!(next_seen(&seen, "its message"), Ok((1, 0)));
        nothing_for_a_while(&seen, "the sender quiet");
        doomed.kill();
        assert_eq!(next_seen(&seen, &format!("the end after the kill ({way:?})")), Err("Disconnected".into()));
        reader.join().unwrap();
    }
}

/// A sender streaming messages (a `len`-byte tensor each) SIGKILLed while the receiver keeps up
/// (blocked between messages) beside another streaming sender: the killed one's messages arrive
/// as a prefix, in order and intact, and the other's every message, then the end.
fn killed_mid_stream(way: Way, len: usize) {
    let path = socket_path("o6-kill-stream");
    let mut receivers = bind_for(way, &path, 8);
    receivers[0].expect_senders(2);
    for r in receivers.iter_mut().skip(1) {
        r.stop_accepting().unwrap();
    }
    let progress = Arc::new(AtomicU64::new(0));
    let done = progress.clone();
    // Reading (and blocked between messages) before either sender starts.
    let reader = thread::spawn(move || {
        let mut waiter = Waiter::new(way, receivers, 3).unwrap();
        let mut next = [0u64; 2];
        let mut errors = Vec::new();
        loop {
            match waiter.wait() {
                Ok(msg) => {
                    let (id, index) = (msg.0 as usize, msg.1);
                    // The burst's one thread is sender 0; the streamer sender 1.
                    assert_eq!(index, next[id], "sender {id}'s order: nothing lost or repeated before the kill");
                    if id == 1 {
                        check(&msg, len, 1);
                    } else {
                        check(&msg, 64, 3);
                    }
                    next[id] += 1;
                }
                Err(Error::Disconnected) => break,
                Err(other) => errors.push(format!("{other:?}")),
            }
            done.fetch_add(1, Ordering::Relaxed);
        }
        errors.extend(waiter.receivers()[0].take_errors().iter().map(|e| format!("{e:?}")));
        (next, errors)
    });
    let len_arg = len.to_string();
    let p = path_str(&path);
    let mut doomed = Peer::start(&["stream", "--to", p, "--id", "1", "--len", &len_arg, "--say-every", "50"], &[]);
    let stays =
        Peer::start(&["burst", "--to", p, "--threads", "1", "--count", "3000", "--len", "64", "--every", "3"], &[]);
    doomed.until("sent 200");
    doomed.kill();
    let (next, errors) = watched(
        &format!("receiving around a killed streamer ({way:?})"),
        &progress,
        Duration::from_secs(40),
        String::new,
        move || reader.join().unwrap(),
    );
    assert_eq!(next[0], 3000, "the other sender's every message");
    assert!(next[1] > 200, "the killed sender's sends 0..=200 returned before the kill, {} arrived", next[1]);
    eprintln!("{way:?}, {len} B: {} of the killed sender's messages, then {errors:?}", next[1]);
    drop(stays);
}

#[test]
fn a_streaming_sender_killed_while_the_receiver_keeps_up_leaves_an_intact_prefix_and_the_other_whole() {
    for way in [Way::Block, Way::Async, Way::Select, Way::Poll] {
        killed_mid_stream(way, 64);
    }
}

#[test]
fn a_sender_of_megabyte_tensors_killed_mid_stream_leaves_an_intact_prefix_and_the_other_whole() {
    killed_mid_stream(Way::Block, 1 << 20);
    killed_mid_stream(Way::Poll, 1 << 20);
}

/// One sender streams 20,000 messages with jitter while six short-lived sender programs come
/// and go one after the other (each 2,000 messages with jitter), the receiver waiting in `way`
/// between messages: it goes from one sender to two and back, over and over. Every message
/// arrives, in per-sender order, then the end.
fn senders_come_and_go_while_one_streams(way: Way, env: &[(&str, &str)]) {
    let seed = seed();
    let path = socket_path("o6-come-go");
    let mut receivers = bind_for(way, &path, 8);
    receivers[0].expect_senders(7);
    for r in receivers.iter_mut().skip(1) {
        r.stop_accepting().unwrap();
    }
    let progress = Arc::new(AtomicU64::new(0));
    let done = progress.clone();
    let reader = thread::spawn(move || {
        let mut waiter = Waiter::new(way, receivers, seed).unwrap();
        let mut next = [0u64; 7];
        loop {
            match waiter.wait() {
                Ok(msg) => {
                    let id = msg.0 as usize;
                    assert_eq!(msg.1, next[id], "sender {id}'s order");
                    check(&msg, 100, 5);
                    next[id] += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Err(Error::Disconnected) => return next,
                Err(other) => panic!("after {next:?}: {other:?}"),
            }
        }
    });
    let p = path_str(&path).to_string();
    let jitter = seed.to_string();
    let common = ["--threads", "1", "--len", "100", "--every", "5", "--jitter", &jitter];
    let mut streamer =
        Peer::start(&[&["burst", "--to", &p, "--id-base", "0", "--count", "20000"][..], &common].concat(), env);
    let visitors = thread::spawn({
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let jitter = jitter.clone();
        move || {
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            for id in 1..7 {
                let id = id.to_string();
                let args = ["burst", "--to", &p, "--id-base", &id, "--count", "2000", "--threads", "1"];
                let rest = ["--len", "100", "--every", "5", "--jitter", &jitter];
                let mut visitor = Peer::start(&[&args[..], &rest].concat(), &env);
                visitor.until("done");
                assert!(visitor.finish().success(), "visitor {id}");
            }
        }
    });
    let next = watched(
        &format!("senders coming and going ({way:?}, seed {seed})"),
        &progress,
        Duration::from_secs(40),
        String::new,
        move || reader.join().unwrap(),
    );
    visitors.join().unwrap();
    assert_eq!(next, [20000, 2000, 2000, 2000, 2000, 2000, 2000]);
    streamer.until("done");
    assert!(streamer.finish().success());
}

#[test]
fn senders_coming_and_going_beside_a_streaming_one_lose_no_wake_up() {
    for way in [Way::Block, Way::Poll, Way::Select, Way::Async, Way::AsyncCancel] {
        senders_come_and_go_while_one_streams(way, &[]);
    }
}

#[test]
fn senders_on_the_socket_alone_coming_and_going_beside_a_streaming_one_lose_no_wake_up() {
    senders_come_and_go_while_one_streams(Way::Block, &[("TQ_RINGS", "0")]);
    senders_come_and_go_while_one_streams(Way::Timeout, &[("TQ_RINGS", "0")]);
}

// ---------------------------------------------------------------------------------------------
// 3. Bursts right after connect

/// `threads` senders of one process, one per thread, each sending `count` messages the moment
/// its connect returned, the process returning from `main` right after; the receiver is
/// blocked before the burst (`blocked`) or does not read until the burst is over. Every
/// message arrives, in per-sender order, intact.
fn burst_after_connect(threads: u32, count: u64, capacity: u32, blocked: bool, way: Way) {
    burst_after_connect_with(threads, count, capacity, blocked, way, &[]);
}

/// `burst_after_connect`, with `env` the sending program's environment.
fn burst_after_connect_with(threads: u32, count: u64, capacity: u32, blocked: bool, way: Way, env: &[(&str, &str)]) {
    let path = socket_path("o6-burst");
    let mut receivers = bind_for(way, &path, capacity);
    receivers[0].expect_senders(threads as usize);
    for r in receivers.iter_mut().skip(1) {
        r.stop_accepting().unwrap();
    }
    let (t, c) = (threads.to_string(), count.to_string());
    let progress = Arc::new(AtomicU64::new(0));
    let done = progress.clone();
    let (start_tx, start) = mpsc::channel::<()>();
    let reader = thread::spawn(move || {
        let mut waiter = Waiter::new(way, receivers, 11).unwrap();
        if !blocked {
            let _ = start.recv(); // not reading until told
        }
        let mut next = vec![0u64; threads as usize];
        loop {
            match waiter.wait() {
                Ok(msg) => {
                    let id = msg.0 as usize;
                    assert_eq!(msg.1, next[id], "sender {id}'s order");
                    check(&msg, 100, 4);
                    next[id] += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Err(Error::Disconnected) => return (next, waiter.receivers()[0].take_errors()),
                Err(other) => panic!("after {next:?}: {other:?}"),
            }
        }
    });
    let mut peer = Peer::start(
        &["burst", "--to", path_str(&path), "--threads", &t, "--count", &c, "--len", "100", "--every", "4"],
        env,
    );
    if !blocked {
        // Not reading for a while. (The program may not be able to return from main meanwhile:
        // dropping a sender waits, up to SENDER_DROP_TIMEOUT, for what the socket could not take,
        // and a burst right after connect starts on the socket before the rings are on.)
        thread::sleep(Duration::from_millis(1000));
        start_tx.send(()).unwrap();
    }
    let (next, errors) = watched(
        &format!("a burst of {threads} x {count} after connect (capacity {capacity}, blocked {blocked}, {way:?})"),
        &progress,
        Duration::from_secs(40),
        String::new,
        move || reader.join().unwrap(),
    );
    assert!(next.iter().all(|&n| n == count), "every sender's every message: {next:?}, errors {errors:?}");
    assert!(errors.is_empty(), "nothing lost, nothing to report: {errors:?}");
    peer.until("done");
    assert!(peer.finish().success());
}

#[test]
fn a_burst_from_eight_threads_right_after_connect_reaches_a_receiver_blocked_before_it() {
    burst_after_connect(8, 2000, 8, true, Way::Block);
}

#[test]
fn a_burst_from_eight_threads_right_after_connect_reaches_a_receiver_blocked_in_select_or_poll() {
    burst_after_connect(8, 1000, 8, true, Way::Select);
    burst_after_connect(8, 1000, 8, true, Way::Poll);
}

#[test]
fn a_burst_right_after_connect_that_fits_the_queue_arrives_whole_when_read_late() {
    // The receiver does not read for a second: the whole burst fits its queue meanwhile.
    burst_after_connect(8, 500, 512, false, Way::Block);
    burst_after_connect(4, 300, 300, false, Way::Async);
}

#[test]
fn a_burst_right_after_connect_to_a_receiver_that_does_not_read_for_a_while_arrives_whole() {
    burst_after_connect(6, 2000, 4, false, Way::Block);
}

#[test]
fn a_burst_right_after_connect_over_the_socket_alone_arrives_whole() {
    burst_after_connect_with(8, 1500, 8, true, Way::Block, &[("TQ_RINGS", "0")]);
    burst_after_connect_with(8, 400, 400, false, Way::Poll, &[("TQ_RINGS", "0")]);
}

#[test]
fn bursts_of_many_short_lived_channels_each_arrive_whole_from_their_first_message() {
    // The first messages of a new channel, again and again.
    for round in 0..20 {
        let way = [Way::Block, Way::Poll, Way::Async, Way::Try][round % 4];
        burst_after_connect(3, 50, 4, round % 2 == 0, way);
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Many tensors

/// `count` messages of `n` tensors from a peer process, every one held until all have come, then
/// each checked against what the sender made; then released, and the sender hears of it.
fn many_held(n: usize, count: u64) {
    let path = socket_path("o6-many");
    let mut receiver = Receiver::<Msg>::builder().capacity(count as u32).bind(&path).unwrap();
    receiver.expect_senders(1);
    let (c, t) = (count.to_string(), n.to_string());
    let mut peer = Peer::start(&["many", "--to", path_str(&path), "--count", &c, "--tensors", &t, "--released"], &[]);
    let progress = Arc::new(AtomicU64::new(0));
    let done = progress.clone();
    let (held, receiver) = watched(
        &format!("{count} messages of {n} tensors"),
        &progress,
        Duration::from_secs(50),
        String::new,
        move || {
            let mut held = Vec::new();
            while (held.len() as u64) < count {
                held.push(receiver.recv().unwrap_or_else(|e| panic!("message {}: {e:?}", held.len())));
                done.fetch_add(1, Ordering::Relaxed);
            }
            (held, receiver)
        },
    );
    for (index, msg) in held.iter().enumerate() {
        assert_eq!(msg.1, index as u64, "order");
        if let Some(diff) = many_tensors_differ(msg.1, n, &msg.2) {
            panic!("{diff}");
        }
    }
    peer.until("done");
    drop(held);
    assert_eq!(peer.line(), "released true", "every message released once dropped");
    assert!(peer.finish().success());
    let mut receiver = receiver;
    assert!(matches!(receiver.recv_timeout(Duration::from_secs(30)), Err(Error::Disconnected)));
}

#[test]
fn forty_messages_of_1024_small_host_tensors_of_every_layout_held_at_once_arrive_exact() {
    many_held(1024, 40);
}

#[test]
fn fifteen_messages_of_4096_small_host_tensors_of_every_layout_held_at_once_arrive_exact() {
    many_held(4096, 15);
}

#[test]
fn a_receiver_process_holding_many_tensor_messages_from_this_process_finds_them_exact() {
    // The other direction: this process sends, the peer holds and checks.
    for (n, count) in [(1024u64, 20u64), (4096, 6)] {
        let path = socket_path("o6-many-rx");
        let (c, t) = (count.to_string(), n.to_string());
        let mut peer = Peer::start(&["hold-many", "--to", path_str(&path), "--count", &c, "--tensors", &t], &[]);
        peer.until("bound");
        let sender = Sender::<Msg>::connect(&path).unwrap();
        for index in 0..count {
            sender.send(&(0, index, integration_tests::outside6::many_tensors(index, n as usize).unwrap())).unwrap();
        }
        assert_eq!(peer.until_prefix("ok").as_str(), format!("ok {count}"), "the peer found every message exact");
        assert!(peer.finish().success());
        assert!(sender.wait_released(Duration::from_secs(30)), "released once the peer exited");
    }
}

#[test]
fn many_tensor_messages_interleaved_with_small_ones_from_two_senders_keep_order_and_data() {
    let path = socket_path("o6-many-mixed");
    let mut receiver = Receiver::<Msg>::builder().capacity(16).bind(&path).unwrap();
    receiver.expect_senders(3); // the wide one, and the small ones' two threads
    let p = path_str(&path);
    let mut wide = Peer::start(&["many", "--to", p, "--id", "0", "--count", "30", "--tensors", "4096"], &[]);
    let mut small =
        Peer::start(&["burst", "--to", p, "--threads", "2", "--count", "3000", "--len", "100", "--every", "4"], &[]);
    // The burst's threads are senders 0 and 1 of their process: tell them apart by tensor count.
    let progress = Arc::new(AtomicU64::new(0));
    let done = progress.clone();
    let got = watched("wide and small messages", &progress, Duration::from_secs(50), String::new, move || {
        let mut wide_next = 0u64;
        let mut small_next = [0u64; 2];
        let mut held = Vec::new();
        loop {
            match receiver.recv() {
                Ok(msg) if msg.2.len() > 1 => {
                    assert_eq!(msg.1, wide_next, "the wide sender's order");
                    if let Some(diff) = many_tensors_differ(msg.1, 4096, &msg.2) {
                        panic!("{diff}");
                    }
                    wide_next += 1;
                    held.push(msg);
                }
                Ok(msg) => {
                    let id = msg.0 as usize;
                    assert_eq!(msg.1, small_next[id], "small sender {id}'s order");
                    check(&msg, 100, 4);
                    small_next[id] += 1;
                }
                Err(Error::Disconnected) => return (wide_next, small_next),
                Err(other) => panic!("{other:?}"),
            }
            done.fetch_add(1, Ordering::Relaxed);
            if wide_next == 30 && small_next == [3000, 3000] {
                return (wide_next, small_next);
            }
        }
    });
    assert_eq!(got, (30, [3000, 3000]));
    small.until("done");
    assert!(small.finish().success());
    wide.until("done");
    assert!(wide.finish().success());
}

#[test]
fn a_sender_of_4096_tensor_messages_killed_mid_stream_leaves_whole_messages_then_the_end() {
    killed_sending_many(&[]);
}

#[test]
fn a_sender_of_4096_tensor_messages_on_the_socket_alone_killed_mid_frame_leaves_whole_messages_then_the_end() {
    // Over the socket, a 4,096-tensor message is a frame of many packets: a kill lands mid-frame.
    killed_sending_many(&[("TQ_RINGS", "0")]);
}

fn killed_sending_many(env: &[(&str, &str)]) {
    // A sender of 4,096-tensor messages SIGKILLed mid-stream: the receiver gets whole messages
    // (never a half-described one), in order, then a typed end.
    let path = socket_path("o6-many-kill");
    let mut receiver = Receiver::<Msg>::builder().capacity(4).bind(&path).unwrap();
    receiver.expect_senders(1);
    let mut peer = Peer::start(&["many", "--to", path_str(&path), "--count", "100000", "--tensors", "4096"], env);
    let mut next = 0u64;
    while next < 5 {
        let msg = receiver.recv_timeout(LONG).unwrap();
        assert_eq!(msg.1, next);
        assert!(many_tensors_differ(msg.1, 4096, &msg.2).is_none());
        next += 1;
    }
    peer.kill();
    let progress = Arc::new(AtomicU64::new(0));
    let done = progress.clone();
    let (next, errors) = watched("after the kill", &progress, Duration::from_secs(40), String::new, move || {
        loop {
            match receiver.recv() {
                Ok(msg) => {
                    assert_eq!(msg.1, next, "order");
                    if let Some(diff) = many_tensors_differ(msg.1, 4096, &msg.2) {
                        panic!("{diff}");
                    }
                    next += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Err(Error::Disconnected) => return (next, receiver.take_errors()),
                Err(other) => panic!("after {next}: {other:?}"),
            }
        }
    });
    eprintln!("{next} whole messages, then the end; reported: {errors:?}");
    assert_eq!(peer.child.wait().unwrap().signal(), Some(9));
}

/// The lies `outside6-peer lie` tells, each about a message of many views of one storage, that
/// must be refused (typed, on both sides) rather than delivered. The others (a row more than the
/// payload names, overlapping rows, records over the same bytes) may also be delivered, as
/// exactly what the payload and table name.
const REFUSED_LIES: [&str; 7] = [
    "missing-row",
    "beyond",
    "huge-shape",
    "negative-stride",
    "bad-storage-index",
    "storage-beyond-chunk",
    "unknown-chunk",
];

/// A raw peer replays a real sender's message of `n` views of one storage, honest and then with
/// lies in its table (row counts, rows beyond their storage, a storage beyond its chunk, an
/// unknown chunk, overlapping rows and records), each on a connection of its own, while an honest
/// sender of this process streams: the honest replay arrives exact; each lie is refused with a
/// typed error the liar hears and the receiver reports, or (an unused extra row, overlaps, which
/// views may do) is delivered as exactly what its table says; the honest sender loses nothing.
fn lies_in_a_table_of_many_rows(n: usize) {
    let path = socket_path("o6-lie");
    let mut receiver = Receiver::<Msg>::builder().capacity(16).bind(&path).unwrap();
    let honest = {
        let path = path.clone();
        thread::spawn(move || {
            let sender = Sender::<Msg>::connect(&path).unwrap();
            for index in 0..2000 {
                sender.send(&message(7, index, 100, 4)).unwrap();
                if index % 50 == 0 {
                    thread::sleep(Duration::from_millis(10)); // spread over the liar's cases
                }
            }
        })
    };
    let t = n.to_string();
    let mut liar = Peer::start(&["lie", "--to", path_str(&path), "--tensors", &t], &[("TQ_RINGS", "0")]);
    let progress = Arc::new(AtomicU64::new(0));
    let done = progress.clone();
    let (stop_tx, stop) = mpsc::channel::<()>();
    let reader = thread::spawn(move || {
        let (mut honest_next, mut delivered, mut rejected) = (0u64, Vec::new(), Vec::new());
        loop {
            match receiver.recv_timeout(Duration::from_millis(100)) {
                Ok(msg) if msg.0 == 7 => {
                    assert_eq!(msg.1, honest_next, "the honest sender's order");
                    check(&msg, 100, 4);
                    honest_next += 1;
                }
                Ok(msg) => {
                    // A replay: exactly what was sent, or (overlapping rows) every row the first.
                    let exact = many_tensors_differ(0, n, &msg.2);
                    let first = integration_tests::outside6::many_tensors(0, n).unwrap()[0].to_bytes().unwrap();
                    let all_first = msg.2.len() == n && msg.2.iter().all(|t| t.to_bytes().unwrap() == first);
                    delivered.push((exact, all_first));
                }
                // Disconnected: for now (every connection so far has gone); the next may come.
                Err(Error::Timeout | Error::Disconnected) => {
                    thread::sleep(Duration::from_millis(5));
                    if stop.try_recv().is_ok() && honest_next == 2000 {
                        return (honest_next, delivered, rejected, receiver.take_errors());
                    }
                }
                Err(error @ Error::Rejected { .. }) => rejected.push(format!("{error:?}")),
                Err(other) => panic!("recv: {other:?} (expected a message, a rejection or nothing)"),
            }
            done.fetch_add(1, Ordering::Relaxed);
        }
    });
    let mut answers = std::collections::BTreeMap::new();
    loop {
        let line = liar.line();
        assert!(!line.starts_with("stuck"), "the liar's watchdog: {line}");
        if line == "done" {
            break;
        }
        if let Some(rest) = line.strip_prefix("answer ") {
            let (name, answer) = rest.split_once(' ').unwrap();
            answers.insert(name.to_string(), answer.to_string());
        }
    }
    stop_tx.send(()).unwrap();
    let (honest_got, delivered, rejected, errors) =
        watched("the receiver around the liar", &progress, Duration::from_secs(40), String::new, move || {
            reader.join().unwrap()
        });
    honest.join().unwrap();
    eprintln!("answers: {answers:#?}\ndelivered: {delivered:?}\nrejected: {rejected:#?}\nerrors: {errors:#?}");
    assert_eq!(honest_got, 2000, "the honest sender's every message");
    assert_eq!(answers.get("honest").map(String::as_str), Some("released"), "the honest replay: {answers:?}");
    assert!(
        delivered.first().is_some_and(|(exact, _)| exact.is_none()),
        "the honest replay arrives exact: {delivered:?}"
    );
    for lie in REFUSED_LIES {
        let answer = answers.get(lie).map(String::as_str).unwrap_or("(no answer line)");
        assert!(
            answer.starts_with("rejected") || answer.starts_with("closed") || answer.starts_with("hung-up"),
            "lie {lie}: the liar heard {answer:?}, expected a rejection or the connection closed"
        );
    }
    for lie in ["extra-row", "overlap-rows", "overlap-storages"] {
        let answer = answers.get(lie).map(String::as_str).unwrap_or("(no answer line)");
        assert!(
            ["released", "rejected", "closed", "hung-up"].iter().any(|a| answer.starts_with(a)),
            "lie {lie}: the liar heard {answer:?}, expected its message delivered or refused"
        );
    }
    // Beyond the honest replay, a delivered message is an extra row or an overlap, exactly as its
    // payload and table say.
    for (i, (exact, all_first)) in delivered.iter().enumerate().skip(1) {
        assert!(
            exact.is_none() || *all_first,
            "delivered message {i} is neither the sent data nor its overlap: {exact:?}"
        );
    }
    let lies_delivered = ["extra-row", "overlap-rows", "overlap-storages"]
        .iter()
        .filter(|lie| answers.get(**lie).is_some_and(|a| a == "released"))
        .count();
    assert_eq!(delivered.len(), 1 + lies_delivered, "delivered: the honest replay and the lies released: {answers:?}");
    // The receiver says what it refused: each refused lie is a rejection or a closed connection.
    let refused = answers.values().filter(|a| a.as_str() != "released").count();
    assert!(
        rejected.len() + errors.len() >= refused,
        "{refused} messages refused, but the receiver reported {} rejections and {} errors",
        rejected.len(),
        errors.len()
    );
    assert!(liar.finish().success());
}

#[test]
fn lies_in_a_table_of_1024_rows_are_refused_typed_and_the_receiver_serves_the_others() {
    lies_in_a_table_of_many_rows(1024);
}

#[test]
fn lies_in_a_table_of_4096_rows_are_refused_typed_and_the_receiver_serves_the_others() {
    lies_in_a_table_of_many_rows(4096);
}

#[test]
// Outside round 6, B1 (fixed): a zero timeout answered Empty.
fn recv_timeout_of_zero_or_a_few_nanoseconds_with_nothing_waiting_is_timeout() {
    // The docs: `recv_timeout` "waits up to `timeout`"; a wait whose time passed is `Timeout`
    // (its example), and `Empty` is `try_recv`'s. A loop `Err(Timeout) => continue` with a
    // computed, sometimes tiny, timeout must not meet another error.
    let path = socket_path("o6-zero");
    let mut receiver = Receiver::<Msg>::bind(&path).unwrap();
    let sender = Sender::<Msg>::connect(&path).unwrap();
    sender.wait_ready(LONG).unwrap();
    let mut wrong = Vec::new();
    for nanos in [0u64, 1, 10, 50, 100, 500, 1000, 10_000] {
        for _ in 0..20 {
            match receiver.recv_timeout(Duration::from_nanos(nanos)) {
                Err(Error::Timeout) => {}
                other => wrong.push((nanos, format!("{:?}", other.map(|m| m.1)))),
            }
        }
    }
    wrong.dedup();
    assert!(wrong.is_empty(), "recv_timeout(ns) with nothing waiting, expected Timeout: {wrong:?}");
}
