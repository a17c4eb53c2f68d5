//! Round 7 of the outside tester's attacks, written from the README and the rustdoc of public
//! items only: channels across "hosts" (TCP on 127.0.0.1, with a secret) carrying host tensors
//! as a demanding user sends them. Several senders per process (own connections and clones
//! shared by threads) and several processes into one receiver, sizes from 0 bytes to 64 MiB
//! mixed in one stream, every byte checked and per-sender order; a consumer holding hundreds of
//! messages while more arrive; a consumer that stops reading; senders SIGKILLed while sending
//! 256 MiB, right after `send` returned and right after `wait_written` said written; a receiver
//! SIGKILLed with senders mid-message and with senders waiting for credits; raw connectors that
//! stall or lie in the handshake beside honest senders; views of mixed dtypes in one message.
//! Second processes: `outside7-peer`; the messages: `integration_tests::outside7`.
//!
//! Every bound here is a generous "does not hang" bound, never a speed assertion.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use integration_tests::outside7::{KEY, Msg, bytes, check, message};
use integration_tests::{bin_path, stdout_lines};
use tensor_queue::{DType, Error, Receiver, Secret, Sender, Tensor};

const LONG: Duration = Duration::from_secs(120);

/// Runs `f` on a thread and fails the test if it has not returned within `bound`.
fn within<R: Send + 'static>(bound: Duration, what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(bound) {
        Ok(value) => value,
        Err(_) => panic!("{what} did not return within {bound:?}"),
    }
}

fn secret() -> Secret {
    Secret::from_bytes(KEY.as_bytes().to_vec()).unwrap()
}

/// A TCP receiver on a free loopback port, and its endpoint.
fn tcp_receiver(capacity: u32) -> (Receiver<Msg>, String) {
    let rx = Receiver::<Msg>::builder().capacity(capacity).secret(secret()).bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", rx.local_addr().unwrap().port());
    (rx, endpoint)
}

fn tcp_sender(endpoint: &str) -> Sender<Msg> {
    Sender::<Msg>::builder().secret(secret()).timeout(Duration::from_secs(60)).connect(endpoint).unwrap()
}

/// True when `errors` reports a message lost mid-way (`ConnectionClosed` caused by `Unfinished`).
fn reports_unfinished(errors: &[Error]) -> bool {
    errors
        .iter()
        .any(|e| matches!(e, Error::ConnectionClosed { cause, .. } if matches!(**cause, Error::Unfinished { .. })))
}

/// A peer process and its stdout lines; killed when dropped (a failing test leaves nothing).
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
    name: String,
}

impl Peer {
    fn start(args: &[&str]) -> Peer {
        Peer::start_with(args, KEY)
    }

    fn start_with(args: &[&str], key: &str) -> Peer {
        let mut command = Command::new(bin_path("outside7-peer").unwrap());
        command.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).env("TQ_SECRET", key);
        let mut child = command.spawn().unwrap();
        let name = format!("outside7-peer {}", args.join(" "));
        let lines = stdout_lines(&mut child, Some(format!("outside7-peer {}", args[0])));
        Peer { child, lines, name }
    }

    /// The next line, within `LONG`.
    fn line(&self) -> String {
        self.lines.recv_timeout(LONG).unwrap_or_else(|_| panic!("no line from {} within {LONG:?}", self.name))
    }

    /// The next line starting with `prefix` (the rest of it), skipping others.
    fn until_prefix(&self, prefix: &str) -> String {
        loop {
            let line = self.line();
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_string();
            }
        }
    }

    fn tell(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().expect("the peer's stdin");
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
        rustix::process::kill_process(pid, signal).unwrap();
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

    /// The kernel's count for this peer of `field` from `/proc/PID/io` (`wchar`), or `VmRSS`
    /// from `/proc/PID/status`, in bytes.
    fn io(&self, field: &str) -> u64 {
        let (file, scale) = if field == "VmRSS" { ("status", 1024) } else { ("io", 1) };
        let text = std::fs::read_to_string(format!("/proc/{}/{file}", self.child.id())).unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix(field).and_then(|v| v.strip_prefix(":")))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |v| v * scale)
    }

    /// Waits until the peer's `field` count grew by `bytes` past `start`.
    fn wait_io(&self, field: &str, start: u64, bytes: u64) {
        let deadline = Instant::now() + LONG;
        while self.io(field) < start + bytes {
            assert!(Instant::now() < deadline, "{} never moved {bytes} bytes ({field})", self.name);
            thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Receives until every sender in `want` (sender id -> message count) has delivered all, checking
/// each message's bytes and each sender's order; returns the receiver and how many arrived.
fn receive_streams(mut rx: Receiver<Msg>, want: BTreeMap<u32, u64>, top: usize) -> (Receiver<Msg>, u64) {
    let total: u64 = want.values().sum();
    within(Duration::from_secs(400), "receiving the mixed streams", move || {
        let mut next: BTreeMap<u32, u64> = want.keys().map(|&s| (s, 0)).collect();
        for n in 0..total {
            let msg = match rx.recv_timeout(LONG) {
                Ok(msg) => msg,
                Err(e) => panic!("message {n} of {total}: {e:?}; errors: {:?}", rx.take_errors()),
            };
            let expected = next.get_mut(&msg.0).unwrap_or_else(|| panic!("a message of unknown sender {}", msg.0));
            assert_eq!(msg.1, *expected, "sender {}'s messages out of order (or one lost or repeated)", msg.0);
            *expected += 1;
            if let Err(why) = check(&msg, top) {
                panic!("{why}");
            }
        }
        assert_eq!(next, want, "every sender's messages");
        (rx, total)
    })
}

// ---------------------------------------------------------------------------------------------
// 1. Many senders, threads and processes, sizes from 0 bytes to 64 MiB in one stream.

#[test]
fn mixed_sizes_from_threads_and_processes_arrive_exact_and_in_per_sender_order() {
    let (rx, endpoint) = tcp_receiver(8);
    let count = 12u64;
    // Two processes of three threads each (two connections, one shared by two threads).
    let mut peers: Vec<Peer> = [10u32, 20]
        .iter()
        .map(|first| Peer::start(&["send", &endpoint, &first.to_string(), "3", &count.to_string(), "7", "wait"]))
        .collect();
    // And two threads of this process: one connection each, plus a clone of the first.
    let tx = tcp_sender(&endpoint);
    let mine: Vec<_> = [(0u32, tx.clone()), (1, tx), (2, tcp_sender(&endpoint))]
        .into_iter()
        .map(|(id, tx)| {
            thread::spawn(move || {
                for i in 0..count {
                    tx.send_timeout(&message(id, i, 7), LONG).unwrap();
                }
                assert!(tx.wait_written(LONG), "sender {id}: not written");
                tx
            })
        })
        .collect();
    let want: BTreeMap<u32, u64> = [0, 1, 2, 10, 11, 12, 20, 21, 22].into_iter().map(|s| (s, count)).collect();
    let (mut rx, _) = receive_streams(rx, want, 7);
    let _mine: Vec<_> = mine.into_iter().map(|h| h.join().unwrap()).collect();
    for peer in &mut peers {
        assert_eq!(peer.until_prefix("written "), "true");
        assert!(peer.finish().success());
    }
    // Everything was delivered: the senders leaving is no lost message, and nothing more comes.
    assert!(!reports_unfinished(&rx.take_errors()));
    assert!(matches!(rx.try_recv(), Err(Error::Empty | Error::Disconnected)));
}

// ---------------------------------------------------------------------------------------------
// 2. A consumer that holds hundreds of messages while more arrive.

#[test]
fn a_consumer_holding_hundreds_of_messages_while_more_arrive_finds_them_unaltered() {
    let (mut rx, endpoint) = tcp_receiver(16);
    let count = 150u64;
    // Sizes up to 1 MiB (`SIZES[5]`), four streams from two processes: 600 messages held.
    let mut peers: Vec<Peer> = [30u32, 40]
        .iter()
        .map(|first| Peer::start(&["send", &endpoint, &first.to_string(), "2", &count.to_string(), "5", "written-die"]))
        .collect();
    let held = within(Duration::from_secs(300), "receiving and holding 600 messages", move || {
        let mut held: Vec<Msg> = Vec::new();
        for n in 0..4 * count {
            let msg = rx.recv_timeout(LONG).unwrap_or_else(|e| panic!("message {n}: {e:?}"));
            // Now and then look again at the oldest ones held while more keep arriving.
            if n % 97 == 0 {
                for old in held.iter().take(20) {
                    check(old, 5).unwrap_or_else(|why| panic!("a held message changed: {why}"));
                }
            }
            held.push(msg);
        }
        (rx, held)
    });
    let (mut rx, held) = held;
    for peer in &mut peers {
        assert_eq!(peer.until_prefix("written "), "true", "the peer's wait_written");
        let status = peer.finish();
        assert!(!status.success(), "the peer should have SIGKILLed itself: {status}");
    }
    // Their processes are gone: what this consumer holds is still exactly what they sent.
    let mut next: BTreeMap<u32, u64> = BTreeMap::new();
    for msg in &held {
        let expected = next.entry(msg.0).or_default();
        assert_eq!(msg.1, *expected, "sender {}: order", msg.0);
        *expected += 1;
        check(msg, 5).unwrap_or_else(|why| panic!("after the senders died: {why}"));
    }
    assert_eq!(next.into_values().collect::<Vec<_>>(), vec![count; 4]);
    // The end of the stream: every sender is gone, written whole, so nothing lost is reported.
    let end = within(LONG, "recv after every sender died", move || {
        let end = rx.recv_timeout(Duration::from_secs(60));
        (end, rx.take_errors())
    });
    assert!(matches!(end.0, Err(Error::Disconnected)), "the end: {:?}", end.0);
    assert!(!reports_unfinished(&end.1), "a message written whole was reported lost: {:?}", end.1);
}

// ---------------------------------------------------------------------------------------------
// 3. A consumer that stops reading.

#[test]
fn a_consumer_that_stops_reading_gives_full_and_timeout_then_everything_arrives_once() {
    let (rx, endpoint) = tcp_receiver(4);
    // A peer process with 64 MiB messages in its stream, and two sender threads of this one.
    let mut peer = Peer::start(&["until-full", &endpoint, "50", "7"]);
    let results: Vec<_> = [(0u32, 7usize), (1, 6)]
        .into_iter()
        .map(|(id, top)| {
            let tx = tcp_sender(&endpoint);
            thread::spawn(move || {
                let mut next = 0u64;
                let stopped = loop {
                    match tx.send_timeout(&message(id, next, top), Duration::from_millis(500)) {
                        Ok(()) => next += 1,
                        Err(e) => break e,
                    }
                    assert!(next < 10_000, "sender {id}: 10,000 accepted by a receiver that does not read");
                };
                // try_send must answer at once, whatever the message's size.
                let tried = tx.try_send(&message(id, next, top));
                (tx, next, stopped, tried)
            })
        })
        .collect();
    let results: Vec<_> = within(LONG, "senders against a consumer that does not read", move || {
        results.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    let accepted_peer: u64 = peer.until_prefix("accepted ").parse().unwrap();
    let stopped_peer = peer.until_prefix("stopped ");
    let tried_peer = peer.until_prefix("try_send ");
    assert_eq!(stopped_peer, "Timeout", "the peer's send_timeout on a full queue");
    assert_eq!(tried_peer, "Err(Full)", "the peer's try_send on a full queue");
    let mut want: BTreeMap<u32, u64> = BTreeMap::new();
    let mut senders = Vec::new();
    for (id, (tx, accepted, stopped, tried)) in results.into_iter().enumerate() {
        assert!(matches!(stopped, Error::Timeout), "sender {id}'s send_timeout on a full queue: {stopped:?}");
        assert!(matches!(tried, Err(Error::Full)), "sender {id}'s try_send on a full queue: {tried:?}");
        want.insert(id as u32, accepted);
        senders.push(tx);
    }
    want.insert(50, accepted_peer);
    // Now it reads: exactly what was accepted, once each, in order, every byte.
    let top_of = |s: u32| if s == 1 { 6 } else { 7 };
    let mut rx = within(Duration::from_secs(300), "reading what was accepted", move || {
        let mut rx = rx;
        let total: u64 = want.values().sum();
        let mut next: BTreeMap<u32, u64> = want.keys().map(|&s| (s, 0)).collect();
        for _ in 0..total {
            let msg = rx.recv_timeout(LONG).expect("an accepted message did not arrive");
            let expected = next.get_mut(&msg.0).unwrap();
            assert_eq!(msg.1, *expected, "sender {}", msg.0);
            *expected += 1;
            check(&msg, top_of(msg.0)).unwrap_or_else(|why| panic!("{why}"));
        }
        assert_eq!(next, want);
        match rx.recv_timeout(Duration::from_millis(500)) {
            Err(Error::Timeout) => {}
            Ok(msg) => panic!("a refused message arrived: sender {} index {}", msg.0, msg.1),
            Err(e) => panic!("{e:?}"),
        }
        rx
    });
    // The senders go on, the peer from where it was refused.
    peer.tell("go");
    let more: u64 = peer.until_prefix("more ").parse().unwrap();
    for s in 0..3 {
        let msg = rx.recv_timeout(LONG).unwrap();
        assert_eq!((msg.0, msg.1), (50, more - 3 + s), "the peer's messages after it was refused");
        check(&msg, 7).unwrap();
    }
    assert_eq!(peer.until_prefix("written "), "true");
    assert!(peer.finish().success());
    drop(senders);
    assert!(!reports_unfinished(&rx.take_errors()));
}

// ---------------------------------------------------------------------------------------------
// 4. Senders killed at the worst moments.

#[test]
fn a_sender_killed_while_sending_256_mib_costs_the_mixed_streams_nothing() {
    let (rx, endpoint) = tcp_receiver(8);
    let len = 256usize << 20;
    let mut big = Peer::start(&["big", &endpoint, &len.to_string()]);
    assert_eq!(big.line(), "sending");
    let start = big.io("wchar");
    // This process's streams run meanwhile: two connections, sizes up to 64 MiB.
    let streams: Vec<_> = (0..2u32)
        .map(|id| {
            let tx = tcp_sender(&endpoint);
            thread::spawn(move || {
                for i in 0..10 {
                    tx.send_timeout(&message(id, i, 7), LONG).unwrap();
                }
                assert!(tx.wait_written(LONG));
                tx
            })
        })
        .collect();
    let reader = thread::spawn(move || {
        let mut rx = rx;
        let mut next = [0u64; 2];
        let mut big_got = None;
        while next != [10, 10] {
            let msg = rx.recv_timeout(LONG).unwrap_or_else(|e| panic!("{e:?} after {next:?}"));
            if msg.0 == 77 {
                big_got = Some(msg.2[0].to_bytes().unwrap() == bytes(77, 0, len));
                continue;
            }
            assert_eq!(msg.1, next[msg.0 as usize], "sender {}", msg.0);
            next[msg.0 as usize] += 1;
            check(&msg, 7).unwrap_or_else(|why| panic!("{why}"));
        }
        let mut errors = rx.take_errors();
        let deadline = Instant::now() + Duration::from_secs(60);
        while big_got.is_none() && !reports_unfinished(&errors) && Instant::now() < deadline {
            if let Ok(msg) = rx.recv_timeout(Duration::from_millis(200)) {
                big_got = Some(msg.0 == 77 && msg.2[0].to_bytes().unwrap() == bytes(77, 0, len));
            }
            errors.extend(rx.take_errors());
        }
        (rx, big_got, errors)
    });
    // Kill it once 32 MiB of its 256 MiB are in its socket.
    big.wait_io("wchar", start, 32 << 20);
    big.kill();
    let (mut rx, big_got, errors) =
        within(Duration::from_secs(300), "receiving beside a killed sender", move || reader.join().unwrap());
    let _streams: Vec<_> = streams.into_iter().map(|h| h.join().unwrap()).collect();
    match big_got {
        Some(whole) => assert!(whole, "the killed sender's message arrived torn"),
        None => assert!(reports_unfinished(&errors), "the killed sender's message was lost unreported: {errors:?}"),
    }
    // The receiver takes new senders afterwards.
    let late = tcp_sender(&endpoint);
    late.send(&message(9, 0, 7)).unwrap();
    let msg = rx.recv_timeout(LONG).unwrap();
    assert_eq!((msg.0, msg.1), (9, 0));
    check(&msg, 7).unwrap();
}

/// A peer of three sending threads (sizes up to `SIZES[top]`) that SIGKILLs itself at `end`;
/// every sender's received messages must be a whole prefix of what it sent, and the stream end.
fn sender_process_killed(end: &str, top: usize) -> BTreeMap<u32, u64> {
    let (rx, endpoint) = tcp_receiver(8);
    let count = 20u64;
    let reader = thread::spawn(move || {
        let mut rx = rx;
        let mut got: BTreeMap<u32, u64> = (60..63).map(|s| (s, 0)).collect();
        let end = loop {
            match rx.recv_timeout(LONG) {
                Ok(msg) => {
                    let expected = got.get_mut(&msg.0).expect("a known sender");
                    assert_eq!(msg.1, *expected, "sender {}: a message lost in the middle or repeated", msg.0);
                    *expected += 1;
                    check(&msg, top).unwrap_or_else(|why| panic!("{why}"));
                }
                Err(e) => break e,
            }
        };
        (got, end, rx.take_errors())
    });
    let mut peer = Peer::start(&["send", &endpoint, "60", "3", &count.to_string(), &top.to_string(), end]);
    if end == "written-die" {
        assert_eq!(peer.until_prefix("written "), "true");
    }
    let status = peer.finish();
    assert!(!status.success(), "the peer should have SIGKILLed itself: {status}");
    let (got, end_error, errors) =
        within(Duration::from_secs(300), "receiving from a killed sender", move || reader.join().unwrap());
    assert!(matches!(end_error, Error::Disconnected), "the end of a killed sender's stream: {end_error:?}");
    if end == "written-die" {
        assert_eq!(got.values().copied().collect::<Vec<_>>(), vec![count; 3], "written messages lost; {errors:?}");
        assert!(!reports_unfinished(&errors), "{errors:?}");
    }
    got
}

#[test]
fn a_sender_process_killed_right_after_send_returned_delivers_whole_prefixes_then_the_end() {
    sender_process_killed("die", 7);
}

#[test]
fn a_sender_process_killed_after_wait_written_said_written_has_every_message_delivered() {
    sender_process_killed("written-die", 7);
}

// ---------------------------------------------------------------------------------------------
// 5. A receiver killed under its senders.

/// Three sending threads of this process against a receiver process: `stop` SIGSTOPs it first
/// (its socket fills, the senders wait for credits), then it is SIGKILLed mid-message. Every
/// sender must end with a typed error, `wait_written` and dropping must return.
fn receiver_process_killed(stop: bool) {
    let mut peer = Peer::start(&["recv", "4", "1000000", "7"]);
    let port = peer.until_prefix("port ");
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let rss = peer.io("VmRSS");
    let (progress_tx, progress) = mpsc::channel::<u32>();
    let senders: Vec<_> = (0..3u32)
        .map(|id| {
            let tx = tcp_sender(&endpoint);
            let progress_tx = progress_tx.clone();
            thread::spawn(move || {
                let mut sent = 0u64;
                let error = loop {
                    // `send` without a bound: it must not wait forever on a dead receiver.
                    match tx.send(&message(id, sent, 7)) {
                        Ok(()) => sent += 1,
                        Err(e) => break e,
                    }
                    let _ = progress_tx.send(id);
                    assert!(sent < 100_000);
                };
                let written = tx.wait_written(Duration::from_secs(30));
                let connected = tx.is_connected();
                drop(tx);
                (sent, error, written, connected)
            })
        })
        .collect();
    // Let every sender get going.
    for _ in 0..6 {
        progress.recv_timeout(LONG).expect("the senders made no progress");
    }
    if stop {
        peer.signal(rustix::process::Signal::STOP);
        thread::sleep(Duration::from_secs(2));
    } else {
        peer.wait_io("VmRSS", rss, 32 << 20);
    }
    peer.kill();
    let results: Vec<_> = within(Duration::from_secs(200), "senders to a killed receiver", move || {
        senders.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for (id, (sent, error, written, connected)) in results.into_iter().enumerate() {
        assert!(matches!(error, Error::Disconnected), "sender {id} after {sent} sends: {error:?}");
        assert!(!connected, "sender {id} still connected to a dead receiver");
        let _ = written;
    }
}

#[test]
fn a_receiver_process_killed_mid_message_ends_every_sending_thread_with_disconnected() {
    receiver_process_killed(false);
}

#[test]
fn a_stopped_then_killed_receiver_ends_senders_waiting_for_credits_with_disconnected() {
    receiver_process_killed(true);
}

// ---------------------------------------------------------------------------------------------
// 6. Peers that lie at the socket level, beside honest senders.

/// True when the receiver closed `stream` within `bound`.
fn closed_by_peer(stream: &mut TcpStream, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn silent_and_lying_connectors_and_a_wrong_secret_cost_honest_streams_nothing() {
    let (rx, endpoint) = tcp_receiver(8);
    let addr = endpoint.trim_start_matches("tcp://").to_string();
    // 40 connections that say nothing (more than the 16 handshakes an address may run at
    // once), 8 that send the start of something and stall, 4 that answer with garbage.
    let mut silent: Vec<TcpStream> = (0..40).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    let mut stalled: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            let _ = s.write_all(b"tq-auth-v1\0\0\0\x40");
            s
        })
        .collect();
    let garbage: Vec<_> = (0..4u64)
        .map(|k| {
            let addr = addr.clone();
            thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).unwrap();
                let junk = bytes(1000 + k as u32, k, 1 << 20);
                let _ = s.write_all(&junk);
                closed_by_peer(&mut s, Duration::from_secs(40))
            })
        })
        .collect();
    // A real sender with the wrong secret, from another process.
    let mut impostor = Peer::start_with(&["connect", &endpoint], "not-the-secret-of-this-channel-at-all-000");
    // Honest senders connect after all that and stream sizes up to 64 MiB.
    let mut honest = Peer::start(&["send", &endpoint, "70", "2", "10", "7", "wait"]);
    let mine = thread::spawn({
        let endpoint = endpoint.clone();
        move || {
            let tx = tcp_sender(&endpoint);
            for i in 0..10 {
                tx.send_timeout(&message(5, i, 7), LONG).unwrap();
            }
            assert!(tx.wait_written(LONG));
            tx
        }
    });
    let want: BTreeMap<u32, u64> = [(5, 10), (70, 10), (71, 10)].into_iter().collect();
    let (mut rx, _) = receive_streams(rx, want, 7);
    let _mine = mine.join().unwrap();
    assert_eq!(honest.until_prefix("written "), "true");
    let impostor_said = impostor.line();
    assert!(impostor_said.starts_with("error Core(AuthFailed"), "the wrong secret's connect: {impostor_said}");
    for handle in garbage {
        assert!(handle.join().unwrap(), "a garbage connection was kept open past 40 s");
    }
    for s in silent.iter_mut().chain(stalled.iter_mut()) {
        assert!(closed_by_peer(s, Duration::from_secs(40)), "a silent connector was kept past 40 s");
    }
    let errors = rx.take_errors();
    assert!(!reports_unfinished(&errors), "an honest message was reported lost: {errors:?}");
    // README: a peer without the secret is refused with AuthFailed and reported by take_errors.
    assert!(
        errors.iter().any(|e| matches!(e, Error::Core(ipc_core::Error::AuthFailed { .. }))),
        "the impostor and the garbage are not in take_errors: {errors:?}"
    );
    assert!(honest.finish().success());
    impostor.kill();
}

// ---------------------------------------------------------------------------------------------
// 7. Views of mixed dtypes in one message.

/// A message of views over several storages of several dtypes, each with the f64 values its
/// elements must read as (worked out here from the view's definition, not by the library).
fn views() -> Vec<(&'static str, Tensor, Vec<u64>, Vec<f64>)> {
    let (rows, cols) = (64u64, 48u64);
    let grid: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
    let grid = Tensor::from_slice(&grid, DType::F32, &[rows, cols]).unwrap();
    let at = |i: u64, j: u64| (i * cols + j) as f64;
    let line: Vec<i64> = (0..1000).map(|i| i * 7 - 3000).collect();
    let line = Tensor::from_slice(&line, DType::I64, &[1000]).unwrap();
    let halves: Vec<half::f16> = (0..24).map(|i| half::f16::from_f32(i as f32 * 0.25)).collect();
    let halves = Tensor::from_slice(&halves, DType::F16, &[2, 3, 4]).unwrap();
    let shorts: Vec<i16> = (0..30).map(|i| (i * 1000 - 15000) as i16).collect();
    let shorts = Tensor::from_slice(&shorts, DType::I16, &[5, 6]).unwrap();
    let doubles: Vec<f64> = (0..10).map(|i| i as f64 / 3.0).collect();
    let doubles_t = Tensor::from_slice(&doubles, DType::F64, &[10]).unwrap();

    let mut out = Vec::new();
    let transposed: Vec<f64> = (0..cols).flat_map(|j| (0..rows).map(move |i| at(i, j))).collect();
    out.push(("f32 transpose", grid.transpose(0, 1).unwrap(), vec![cols, rows], transposed));
    let narrowed: Vec<f64> = (0..rows).flat_map(|i| (40..45).map(move |j| at(i, j))).collect();
    out.push(("f32 narrow at an offset", grid.narrow(1, 40, 5).unwrap(), vec![rows, 5], narrowed));
    let row = (0..cols).map(|j| at(17, j)).collect();
    out.push(("f32 select a row", grid.select(0, 17).unwrap(), vec![cols], row));
    out.push(("f32 narrow to nothing", grid.narrow(0, 63, 0).unwrap(), vec![0, cols], vec![]));
    let stepped: Vec<f64> = (0..1000).skip(3).step_by(7).map(|i| (i * 7 - 3000) as f64).collect();
    let n = stepped.len() as u64;
    out.push(("i64 slice step 7", line.slice(0, 3, 1000, 7).unwrap(), vec![n], stepped));
    let flipped: Vec<f64> = (0..1000).rev().map(|i| (i * 7 - 3000) as f64).collect();
    out.push(("i64 flip", line.flip(&[0]).unwrap(), vec![1000], flipped));
    // halves [2,3,4] permuted to [4,2,3]: element (k,a,b) is halves[a][b][k].
    let permuted: Vec<f64> = (0..4)
        .flat_map(|k| (0..2).flat_map(move |a| (0..3).map(move |b| (a * 12 + b * 4 + k) as f64 * 0.25)))
        .collect();
    out.push(("f16 permute", halves.permute(&[2, 0, 1]).unwrap(), vec![4, 2, 3], permuted));
    let column: Vec<f64> = (0..5).map(|i| ((i * 6 + 4) * 1000 - 15000) as f64).collect();
    let expanded: Vec<f64> = (0..3).flat_map(|_| column.clone()).collect();
    out.push(("i16 column expanded", shorts.select(1, 4).unwrap().expand(&[3, 5]).unwrap(), vec![3, 5], expanded));
    out.push(("f64 whole", doubles_t.clone(), vec![10], doubles.clone()));
    out.push(("f64 0-dim", doubles_t.select(0, 9).unwrap(), vec![], vec![3.0]));
    out.push(("u8 empty 3-d", Tensor::zeros(DType::U8, &[2, 0, 7]).unwrap(), vec![2, 0, 7], vec![]));
    out
}

/// The f64 values of a received tensor of any of the dtypes `views` uses.
fn values(t: &Tensor) -> Vec<f64> {
    match t.dtype() {
        DType::F32 => t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect(),
        DType::F64 => t.to_vec::<f64>().unwrap(),
        DType::I64 => t.to_vec::<i64>().unwrap().into_iter().map(|v| v as f64).collect(),
        DType::I16 => t.to_vec::<i16>().unwrap().into_iter().map(f64::from).collect(),
        DType::F16 => t.to_vec::<half::f16>().unwrap().into_iter().map(f64::from).collect(),
        DType::U8 => t.to_vec::<u8>().unwrap().into_iter().map(f64::from).collect(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

#[test]
fn views_of_mixed_dtypes_in_one_message_cross_tcp_exact_between_mixed_stream_messages() {
    let rx = Receiver::<(u64, Vec<Tensor>)>::builder().capacity(4).secret(secret()).bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", rx.local_addr().unwrap().port());
    let tx = Sender::<(u64, Vec<Tensor>)>::builder().secret(secret()).connect(&endpoint).unwrap();
    let want = views();
    let sent: Vec<Tensor> = want.iter().map(|(_, t, _, _)| t.clone()).collect();
    let dtypes: Vec<DType> = sent.iter().map(Tensor::dtype).collect();
    // The views' message between a large and an empty one, three times, from two threads.
    let sending = thread::spawn(move || {
        for round in 0..3u64 {
            let big = bytes(3, round, 8 << 20);
            tx.send(&(round * 3, vec![Tensor::from_bytes(&big, DType::U8, &[8 << 20]).unwrap()])).unwrap();
            tx.send(&(round * 3 + 1, sent.clone())).unwrap();
            tx.send(&(round * 3 + 2, vec![])).unwrap();
        }
        assert!(tx.wait_written(LONG));
        tx
    });
    let mut rx = rx;
    for k in 0..9u64 {
        let (index, tensors) = rx.recv_timeout(LONG).unwrap();
        assert_eq!(index, k);
        match k % 3 {
            0 => assert_eq!(tensors[0].to_bytes().unwrap(), bytes(3, k / 3, 8 << 20)),
            2 => assert!(tensors.is_empty()),
            _ => {
                assert_eq!(tensors.len(), want.len());
                for ((t, (name, _, shape, expected)), dtype) in tensors.iter().zip(&want).zip(&dtypes) {
                    assert_eq!(t.dtype(), *dtype, "{name}: dtype");
                    assert_eq!(t.shape(), &shape[..], "{name}: shape");
                    assert_eq!(&values(t), expected, "{name}: values");
                }
            }
        }
    }
    let _tx = sending.join().unwrap();
}

// ---------------------------------------------------------------------------------------------
// 8. One connection shared by many threads; many connections at once; connection floods.

#[test]
fn eight_threads_sharing_one_sender_interleave_mixed_sizes_exact_in_per_thread_order() {
    let (rx, endpoint) = tcp_receiver(8);
    let tx = tcp_sender(&endpoint);
    let count = 60u64;
    // Sizes up to 4 MiB (`SIZES[6]`), one of them the 4 MiB one at index 3 of every thread.
    let threads: Vec<_> = (0..8u32)
        .map(|id| {
            let tx = tx.clone();
            thread::spawn(move || {
                for i in 0..count {
                    // A mix of the three ways to send, on one connection.
                    let msg = message(id, i, 6);
                    match i % 3 {
                        0 => tx.send(&msg).unwrap(),
                        1 => tx.send_timeout(&msg, LONG).unwrap(),
                        _ => loop {
                            match tx.try_send(&msg) {
                                Ok(()) => break,
                                Err(Error::Full) => thread::sleep(Duration::from_micros(200)),
                                Err(e) => panic!("sender {id}: try_send: {e:?}"),
                            }
                        },
                    }
                }
            })
        })
        .collect();
    let want: BTreeMap<u32, u64> = (0..8).map(|s| (s, count)).collect();
    let (mut rx, _) = receive_streams(rx, want, 6);
    for handle in threads {
        handle.join().unwrap();
    }
    assert!(tx.wait_written(LONG));
    drop(tx);
    assert!(matches!(rx.recv_timeout(LONG), Err(Error::Disconnected)));
    assert!(!reports_unfinished(&rx.take_errors()));
}

/// Honest senders of one host connecting at the same moment (a pool of workers starting).
const AT_ONCE: u32 = 300;

#[test]
fn honest_senders_connecting_at_once_all_get_in() {
    let (rx, endpoint) = tcp_receiver(8);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(AT_ONCE as usize));
    let threads: Vec<_> = (0..AT_ONCE)
        .map(|id| {
            let endpoint = endpoint.clone();
            let barrier = barrier.clone();
            thread::spawn(move || {
                barrier.wait();
                let tx = Sender::<Msg>::builder()
                    .secret(secret())
                    .timeout(Duration::from_secs(60))
                    .connect(&endpoint)
                    .map_err(|e| format!("sender {id}: connect: {e:?}"))?;
                tx.send_timeout(&message(id, 0, 3), LONG).map_err(|e| format!("sender {id}: send: {e:?}"))?;
                Ok::<_, String>(tx)
            })
        })
        .collect();
    let reader = thread::spawn(move || {
        let mut rx = rx;
        let mut seen = Vec::new();
        // Until all came, or none for 20 s (the connects that failed send nothing).
        while seen.len() < AT_ONCE as usize {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(msg) => {
                    check(&msg, 3).unwrap();
                    seen.push(msg.0);
                }
                Err(_) => break,
            }
        }
        (seen, rx.take_errors())
    });
    let results: Vec<_> = within(Duration::from_secs(200), "connects at once", move || {
        threads.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    let (mut seen, errors) = within(Duration::from_secs(200), "receiving", move || reader.join().unwrap());
    // How they failed, by kind ("connect: ..." or "send: ..." and the error's text without the
    // sender's number and port), with how many each.
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for failure in &failed {
        let text = failure.split_once(": ").map_or(failure.as_str(), |(_, rest)| rest);
        let text = text.split(" { peer").next().unwrap_or(text).to_string()
            + &text.split("why: ").nth(1).map(|why| format!(" why: {why}")).unwrap_or_default();
        *kinds.entry(text).or_default() += 1;
    }
    assert!(
        failed.is_empty(),
        "{} of {AT_ONCE} honest senders were kept out: {kinds:#?}; the receiver's errors: {:?}",
        failed.len(),
        &errors[..errors.len().min(3)]
    );
    seen.sort_unstable();
    assert_eq!(seen, (0..AT_ONCE).collect::<Vec<_>>());
}

#[test]
fn a_flood_of_new_connections_cannot_keep_an_honest_sender_out() {
    let (rx, endpoint) = tcp_receiver(8);
    let addr = endpoint.trim_start_matches("tcp://").to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Four threads open connections as fast as they can, each held (silent) until 64 are open
    // per thread, then the oldest closed: always more than 16 handshakes waiting, always new ones.
    let flooders: Vec<_> = (0..4)
        .map(|_| {
            let addr = addr.clone();
            let stop = stop.clone();
            thread::spawn(move || {
                let mut open = std::collections::VecDeque::new();
                let mut made = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(s) = TcpStream::connect(&addr) {
                        open.push_back(s);
                        made += 1;
                    }
                    if open.len() > 64 {
                        open.pop_front();
                    }
                }
                made
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(500));
    let honest = within(Duration::from_secs(150), "honest connects during a flood", move || {
        (0..3u32)
            .map(|id| {
                Sender::<Msg>::builder()
                    .secret(secret())
                    .timeout(Duration::from_secs(30))
                    .connect(&endpoint)
                    .and_then(|tx| tx.send_timeout(&message(id, 0, 4), Duration::from_secs(30)).map(|()| tx))
            })
            .collect::<Vec<_>>()
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let made: u64 = flooders.into_iter().map(|h| h.join().unwrap()).sum();
    let failures: Vec<String> = honest.iter().filter_map(|r| r.as_ref().err()).map(|e| format!("{e:?}")).collect();
    assert!(failures.is_empty(), "honest senders kept out by {made} flood connections: {failures:?}");
    let mut rx = rx;
    for _ in 0..3 {
        let msg = rx.recv_timeout(LONG).unwrap();
        check(&msg, 4).unwrap();
    }
}

#[test]
fn two_processes_each_sending_64_mib_messages_to_the_other_before_receiving_do_not_deadlock() {
    let (rx, endpoint) = tcp_receiver(4);
    let mut peer = Peer::start(&["exchange", &endpoint]);
    let there = format!("tcp://127.0.0.1:{}", peer.until_prefix("port "));
    // Both send three messages, 64 MiB each, before either receives (README: they do not wait
    // for each other).
    let tx = tcp_sender(&there);
    for i in 0..3 {
        tx.send_timeout(&message(1, 3 + 1000 * i, 7), LONG).unwrap();
    }
    assert_eq!(peer.line(), "sent 3");
    let mut rx = rx;
    let got = within(Duration::from_secs(200), "receiving the other's messages", move || {
        (0..3).map(|_| rx.recv_timeout(LONG).map(|m| (m.0, m.1, check(&m, 7)))).collect::<Vec<_>>()
    });
    for (k, got) in got.into_iter().enumerate() {
        assert_eq!(got.unwrap(), (2, 3 + 1000 * k as u64, Ok(())));
    }
    for k in 0..3 {
        assert_eq!(peer.until_prefix("got "), format!("1 {}", 3 + 1000 * k));
    }
    assert!(tx.wait_written(LONG));
    assert!(peer.finish().success());
}

// ---------------------------------------------------------------------------------------------
// 9. A sender that stalls mid-message (SIGSTOP), and a broadcast across hosts with a receiver
// killed.

/// What a receiving thread saw: a message `(sender, index, whether its bytes were right)`, or
/// errors from `take_errors`.
#[derive(Debug)]
enum Seen {
    Msg(u32, u64, bool),
    Errors(Vec<String>),
}

#[test]
fn a_sender_stopped_mid_256_mib_holds_up_no_other_sender_and_finishes_when_resumed() {
    let (rx, endpoint) = tcp_receiver(8);
    let len = 256usize << 20;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (seen_tx, seen) = mpsc::channel::<Seen>();
    let reader = thread::spawn({
        let stop = stop.clone();
        move || {
            let mut rx = rx;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(msg) => {
                        let right = if msg.0 == 77 {
                            msg.2.len() == 1 && msg.2[0].to_bytes().unwrap() == bytes(77, 0, len)
                        } else {
                            check(&msg, 6).is_ok()
                        };
                        let _ = seen_tx.send(Seen::Msg(msg.0, msg.1, right));
                    }
                    Err(Error::Timeout) => {}
                    Err(e) => panic!("recv: {e:?}"),
                }
                let errors = rx.take_errors();
                if !errors.is_empty() {
                    let _ = seen_tx.send(Seen::Errors(errors.iter().map(|e| format!("{e:?}")).collect()));
                }
            }
            rx
        }
    });
    let mut big = Peer::start(&["big", &endpoint, &len.to_string()]);
    assert_eq!(big.line(), "sending");
    let start = big.io("wchar");
    big.wait_io("wchar", start, 32 << 20);
    big.signal(rustix::process::Signal::STOP);
    // While it is stopped mid-message, two senders of this process stream up to 4 MiB each.
    let streams: Vec<_> = (0..2u32)
        .map(|id| {
            let tx = tcp_sender(&endpoint);
            thread::spawn(move || {
                for i in 0..10 {
                    tx.send_timeout(&message(id, i, 6), LONG).unwrap();
                }
                assert!(tx.wait_written(LONG));
                tx
            })
        })
        .collect();
    let mut next = [0u64; 2];
    let mut early_errors = Vec::new();
    while next != [10, 10] {
        match seen.recv_timeout(LONG).expect("the other senders' messages stopped coming") {
            Seen::Msg(77, _, _) => panic!("the stopped sender's message arrived while it was stopped"),
            Seen::Msg(s, i, right) => {
                assert!(right, "sender {s} message {i}: wrong bytes");
                assert_eq!(i, next[s as usize], "sender {s}: order");
                next[s as usize] += 1;
            }
            Seen::Errors(errors) => early_errors.extend(errors),
        }
    }
    let _streams: Vec<_> = streams.into_iter().map(|h| h.join().unwrap()).collect();
    // The others were not held up behind the unfinished message (which is given up only after
    // `UNFINISHED_IDLE`, 30 s, of silence): it is still pending, and finishes once resumed.
    assert!(early_errors.is_empty(), "errors while a sender was merely stopped: {early_errors:?}");
    big.signal(rustix::process::Signal::CONT);
    match seen.recv_timeout(LONG).expect("the resumed sender's message never arrived") {
        Seen::Msg(77, 0, right) => assert!(right, "the resumed sender's 256 MiB arrived altered"),
        other => panic!("after resuming: {other:?}"),
    }
    assert_eq!(big.until_prefix("written "), "true");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _rx = reader.join().unwrap();
    assert!(big.finish().success());
}

#[test]
fn a_broadcast_to_unix_and_tcp_receivers_with_one_killed_mid_message_reaches_the_others_exact() {
    let path = integration_tests::socket_path("o7-bcast");
    let mut local = Receiver::<Msg>::builder().capacity(4).bind(&path).unwrap();
    let (mut remote, endpoint) = tcp_receiver(4);
    let mut doomed = Peer::start(&["recv", "4", "1000000", "7"]);
    let doomed_endpoint = format!("tcp://127.0.0.1:{}", doomed.until_prefix("port "));
    let senders = vec![Sender::<Msg>::connect(&path).unwrap(), tcp_sender(&endpoint), tcp_sender(&doomed_endpoint)];
    let all = tensor_queue::Broadcast::new(senders);
    let count = 8u64;
    let rss = doomed.io("VmRSS");
    let sending = thread::spawn(move || {
        let results = (0..count)
            .map(|i| all.send_timeout(&message(90, i, 7), LONG).map_err(|e| format!("{e:?}")))
            .collect::<Vec<_>>();
        (results, all)
    });
    // The doomed receiver dies while the 64 MiB message (index 3) comes in.
    let mut readers = [("unix", &mut local), ("tcp", &mut remote)];
    let mut got = [0u64; 2];
    let mut killed = false;
    // Read both in turn (each holds at most its capacity), killing the third mid-way.
    while got != [count, count] {
        for (k, (name, rx)) in readers.iter_mut().enumerate() {
            if got[k] == count {
                continue;
            }
            if let Ok(msg) = rx.recv_timeout(Duration::from_millis(50)) {
                assert_eq!((msg.0, msg.1), (90, got[k]), "{name}: order");
                check(&msg, 7).unwrap_or_else(|why| panic!("{name}: {why}"));
                got[k] += 1;
            }
        }
        if !killed && (doomed.io("VmRSS") > rss + (16 << 20) || got.iter().any(|&g| g > 4)) {
            doomed.kill();
            killed = true;
        }
    }
    let (results, all) = within(LONG, "the broadcast's sends", move || sending.join().unwrap());
    assert!(killed);
    for (i, r) in results.iter().enumerate() {
        assert!(r.as_ref().err().is_none_or(|e| e == "Disconnected"), "broadcast send {i}: {r:?}");
    }
    // Sends after the kill: the dead receiver is reported (Disconnected) once its death is seen,
    // and the two others still get every message.
    let mut last = Ok(());
    for i in count..count + 100 {
        last = all.send_timeout(&message(90, i, 5), LONG);
        for (name, rx) in [("unix", &mut local), ("tcp", &mut remote)] {
            let msg = rx.recv_timeout(LONG).unwrap_or_else(|e| panic!("{name}, message {i}: {e:?}"));
            assert_eq!((msg.0, msg.1), (90, i), "{name}: order");
            check(&msg, 5).unwrap_or_else(|why| panic!("{name}: {why}"));
        }
        if last.is_err() {
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    assert!(matches!(last, Err(Error::Disconnected)), "a broadcast send after one receiver was killed: {last:?}");
}

// ---------------------------------------------------------------------------------------------
// 10. Held messages outlive their receiver; a queue of one under eight connections.

#[test]
fn messages_held_after_their_tcp_receiver_is_dropped_stay_exact() {
    let (rx, endpoint) = tcp_receiver(8);
    let mut peer = Peer::start(&["send", &endpoint, "100", "2", "40", "6", "wait"]);
    let want: BTreeMap<u32, u64> = [(100, 40), (101, 40)].into_iter().collect();
    // Hold them all (receive_streams checks and drops; here they are kept).
    let (held, rx) = within(Duration::from_secs(300), "receiving 80 messages", move || {
        let mut rx = rx;
        let held: Vec<Msg> = (0..80).map(|_| rx.recv_timeout(LONG).unwrap()).collect();
        (held, rx)
    });
    assert_eq!(peer.until_prefix("written "), "true");
    assert!(peer.finish().success());
    drop(rx);
    // The receiver is gone; its memory must not be: wait past the arena's idle trim (a second,
    // README "Memory a receiver holds") and allocate a lot meanwhile, then look again.
    let junk: Vec<Vec<u8>> = (0..32).map(|k| vec![k as u8 ^ 0xa5; 4 << 20]).collect();
    thread::sleep(Duration::from_millis(2500));
    let mut next: BTreeMap<u32, u64> = BTreeMap::new();
    for msg in &held {
        let expected = next.entry(msg.0).or_default();
        assert_eq!(msg.1, *expected);
        *expected += 1;
        check(msg, 6).unwrap_or_else(|why| panic!("after the receiver was dropped: {why}"));
    }
    assert_eq!(next, want);
    drop(junk);
}

#[test]
fn a_queue_of_one_under_eight_connections_of_mixed_sizes_loses_and_repeats_nothing() {
    let (rx, endpoint) = tcp_receiver(1);
    let count = 20u64;
    let threads: Vec<_> = (0..8u32)
        .map(|id| {
            let tx = tcp_sender(&endpoint);
            thread::spawn(move || {
                for i in 0..count {
                    tx.send_timeout(&message(id, i, 6), LONG).unwrap();
                }
                assert!(tx.wait_written(LONG));
            })
        })
        .collect();
    let want: BTreeMap<u32, u64> = (0..8).map(|s| (s, count)).collect();
    let (mut rx, _) = receive_streams(rx, want, 6);
    for handle in threads {
        handle.join().unwrap();
    }
    assert!(matches!(rx.recv_timeout(LONG), Err(Error::Disconnected)));
    assert!(!reports_unfinished(&rx.take_errors()));
}

// ---------------------------------------------------------------------------------------------
// 11. Past the TCP message limit.

#[test]
fn a_message_of_more_than_4_gib_of_host_tensors_is_refused_typed_and_the_channel_goes_on() {
    let rx = Receiver::<Vec<Tensor>>::builder().capacity(4).secret(secret()).bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", rx.local_addr().unwrap().port());
    let tx = Sender::<Vec<Tensor>>::builder().secret(secret()).connect(&endpoint).unwrap();
    // Four distinct 1 GiB storages (zeros: no page is touched by this test) and one byte more:
    // README "Host tensors travel over the TCP link, at most 4 GiB a message".
    let mut tensors: Vec<Tensor> = (0..4).map(|_| Tensor::zeros(DType::U8, &[1 << 30]).unwrap()).collect();
    tensors.push(Tensor::from_bytes(&[7], DType::U8, &[1]).unwrap());
    let (result, tx) = within(LONG, "sending 4 GiB + 1 byte", move || (tx.send_timeout(&tensors, LONG), tx));
    assert!(
        matches!(result, Err(Error::TooLarge { .. })),
        "a message of 4 GiB + 1 byte of host tensors over TCP: {result:?}"
    );
    // Its advice fits: the bytes are in tensors already (it said to put them there).
    let text = result.unwrap_err().to_string();
    assert!(text.contains("several messages") && !text.contains("put bulk data in tensors"), "{text}");
    // The channel goes on.
    let mut rx = rx;
    tx.send(&vec![Tensor::from_bytes(&bytes(4, 4, 1000), DType::U8, &[1000]).unwrap()]).unwrap();
    let got = rx.recv_timeout(LONG).unwrap();
    assert_eq!(got.len(), 1, "the refused message (or part of it) arrived");
    assert_eq!(got[0].to_bytes().unwrap(), bytes(4, 4, 1000));
}

// ---------------------------------------------------------------------------------------------
// 12. Sizes at the edges of buffers, split across tensors; one message of a thousand pieces.

#[test]
fn sizes_at_buffer_edges_split_across_tensors_arrive_exact() {
    let rx = Receiver::<(u64, Vec<Tensor>)>::builder().capacity(8).secret(secret()).bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", rx.local_addr().unwrap().port());
    let mut sizes: Vec<usize> = (0..=17).collect();
    for edge in [1usize << 12, 1 << 16, 1 << 17, 212_992, 1 << 18, 1 << 20, 4 << 20, 16 << 20] {
        sizes.extend([edge - 1, edge, edge + 1]);
    }
    // Each size whole, then split in two tensors at a point that moves, then as a thousand-way
    // split for the largest.
    let cases: Vec<Vec<usize>> = sizes
        .iter()
        .flat_map(|&n| [vec![n], vec![n / 3, n - n / 3], vec![0, n, 0]])
        .chain(std::iter::once(vec![(64 << 20) / 1000 + 1; 1000]))
        .collect();
    let expected = cases.clone();
    let sending = thread::spawn(move || {
        let tx = Sender::<(u64, Vec<Tensor>)>::builder().secret(secret()).connect(&endpoint).unwrap();
        for (k, parts) in cases.iter().enumerate() {
            let tensors = parts
                .iter()
                .enumerate()
                .map(|(p, &n)| Tensor::from_bytes(&bytes(p as u32, k as u64, n), DType::U8, &[n as u64]).unwrap())
                .collect();
            tx.send_timeout(&(k as u64, tensors), LONG).unwrap();
        }
        assert!(tx.wait_written(LONG));
        tx
    });
    let mut rx = rx;
    within(Duration::from_secs(300), "receiving the edge sizes", move || {
        for (k, parts) in expected.iter().enumerate() {
            let (index, tensors) = rx.recv_timeout(LONG).unwrap();
            assert_eq!(index, k as u64, "order");
            assert_eq!(tensors.len(), parts.len(), "case {k}");
            for (p, (t, &n)) in tensors.iter().zip(parts).enumerate() {
                assert_eq!(t.shape(), &[n as u64][..], "case {k} part {p}");
                assert!(t.to_bytes().unwrap() == bytes(p as u32, k as u64, n), "case {k} ({parts:?}) part {p}: bytes");
            }
        }
    });
    let _tx = sending.join().unwrap();
}

// ---------------------------------------------------------------------------------------------
// 13. Wake-ups over TCP: ping-pong in every way a user waits (round 6 did it over Unix sockets).

/// `count` round trips between two threads over TCP, both waiting in `way` (two receivers each
/// where the way waits on several), with random short pauses; small and 64 KiB tensors mixed.
fn tcp_ping_pong(way: integration_tests::outside6::Way, count: u64) {
    use integration_tests::outside6::{Rng, Waiter};
    let ends = if way.several() { 2 } else { 1 };
    let bind = || -> (Vec<Receiver<Msg>>, Vec<String>) {
        (0..ends)
            .map(|_| {
                let (rx, endpoint) = tcp_receiver(4);
                (rx, endpoint)
            })
            .unzip()
    };
    let (here, here_endpoints) = bind();
    let (there, there_endpoints) = bind();
    let ponger = thread::spawn(move || {
        let senders: Vec<Sender<Msg>> = here_endpoints.iter().map(|e| tcp_sender(e)).collect();
        let mut waiter = Waiter::new(way, there, 7).unwrap();
        let mut rng = Rng::new(11);
        for index in 0..count {
            let ping = waiter.wait().unwrap_or_else(|e| panic!("{way:?} pong {index}: {e:?}"));
            assert_eq!((ping.0, ping.1), (0, index), "{way:?}: the ping");
            check(&ping, 4).unwrap_or_else(|why| panic!("{way:?}: {why}"));
            rng.jitter();
            senders[(index % ends as u64) as usize].send(&message(1, index, 4)).unwrap();
        }
    });
    let senders: Vec<Sender<Msg>> = there_endpoints.iter().map(|e| tcp_sender(e)).collect();
    within(Duration::from_secs(300), &format!("{count} TCP round trips waiting by {way:?}"), move || {
        let mut waiter = Waiter::new(way, here, 5).unwrap();
        let mut rng = Rng::new(13);
        for index in 0..count {
            rng.jitter();
            senders[(index % ends as u64) as usize].send(&message(0, index, 4)).unwrap();
            let pong = waiter.wait().unwrap_or_else(|e| panic!("{way:?} ping {index}: {e:?}"));
            assert_eq!((pong.0, pong.1), (1, index), "{way:?}: the answer");
            check(&pong, 4).unwrap_or_else(|why| panic!("{way:?}: {why}"));
        }
    });
    ponger.join().unwrap();
}

#[test]
fn tcp_ping_pong_in_every_way_of_waiting_loses_no_wake_up() {
    for way in integration_tests::outside6::Way::ALL {
        tcp_ping_pong(way, 1500);
    }
}
