//! An outside tester's attacks on the host-path API, written from the README and the rustdoc
//! only: iterators, `AsFd`/`Select`, async, conversions, endpoint errors, non-blocking sends,
//! `MessageInfo`, rejected messages, read-only memory, TCP lockout and killed peers.
//!
//! Every bound here is a generous "does not hang" bound, never a speed assertion.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use integration_tests::socket_path;
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

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

#[test]
fn for_loop_ends_when_every_sender_of_a_bound_receiver_has_gone() {
    let path = socket_path("outside-iter");
    let mut rx = Receiver::<u64>::bind(&path).unwrap();
    rx.expect_senders(3);
    let mut producers = Vec::new();
    for s in 0..3u64 {
        let path = path.clone();
        producers.push(thread::spawn(move || {
            let tx = Sender::<u64>::connect(&path).unwrap();
            for i in 0..50u64 {
                tx.send(&(s * 1000 + i)).unwrap();
            }
        }));
    }
    let got = within(Duration::from_secs(60), "for msg in &mut rx", move || {
        let mut got = Vec::new();
        for msg in &mut rx {
            got.push(msg.unwrap());
        }
        // After the end, try_iter yields nothing and does not block.
        assert_eq!(rx.try_iter().count(), 0);
        got
    });
    for p in producers {
        p.join().unwrap();
    }
    assert_eq!(got.len(), 150, "every message is an item before the end");
    for s in 0..3u64 {
        let mine: Vec<u64> = got.iter().copied().filter(|v| v / 1000 == s).collect();
        assert_eq!(mine, (0..50).map(|i| s * 1000 + i).collect::<Vec<_>>(), "per-sender order");
    }
}

#[test]
fn try_iter_does_not_wait_for_a_sender_that_is_still_connected() {
    let path = socket_path("outside-tryiter");
    let mut rx = Receiver::<u32>::bind(&path).unwrap();
    let tx = Sender::<u32>::connect(&path).unwrap();
    tx.send(&1).unwrap();
    tx.send(&2).unwrap();
    // Give the messages a chance to arrive, then drain without blocking.
    let first = rx.recv_timeout(Duration::from_secs(20)).unwrap();
    let (rest, rx) = within(Duration::from_secs(20), "try_iter", move || {
        let rest: Vec<u32> = rx.try_iter().map(|m| m.unwrap()).collect();
        (rest, rx)
    });
    let mut all = vec![first];
    all.extend(rest);
    if all.len() < 2 {
        let mut rx = rx;
        all.push(rx.recv_timeout(Duration::from_secs(20)).unwrap());
    }
    assert_eq!(all, vec![1, 2]);
    drop(tx);
}

#[test]
fn select_wakes_for_the_receiver_with_a_message() {
    use tensor_queue::channel::Select;
    let (pa, pb) = (socket_path("outside-sel-a"), socket_path("outside-sel-b"));
    let mut a = Receiver::<u32>::bind(&pa).unwrap();
    let mut b = Receiver::<u32>::bind(&pb).unwrap();
    let mut select = Select::new();
    let ia = select.add(&a).unwrap();
    let ib = select.add(&b).unwrap();
    let txb = Sender::<u32>::connect(&pb).unwrap();
    txb.send(&7).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let got = loop {
        assert!(std::time::Instant::now() < deadline, "Select never delivered b's message");
        let i = select.ready_timeout(Duration::from_secs(30)).unwrap();
        if i == ia {
            match a.try_recv() {
                Err(Error::Empty) => {}
                other => panic!("a has no sender, got {other:?}"),
            }
        } else if i == ib {
            match b.try_recv() {
                Ok(v) => break v,
                Err(Error::Empty) => {}
                Err(e) => panic!("{e}"),
            }
        }
    };
    assert_eq!(got, 7);
    // Once b's only sender has gone, b stays ready and says Disconnected.
    drop(txb);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(std::time::Instant::now() < deadline, "b never said Disconnected");
        let i = select.ready_timeout(Duration::from_secs(30)).unwrap();
        if i == ib {
            match b.try_recv() {
                Err(Error::Disconnected) => break,
                Err(Error::Empty) => {}
                other => panic!("expected Disconnected, got {other:?}"),
            }
        }
    }
}

#[test]
fn async_send_recv_and_stream_end_when_the_sender_goes() {
    use futures_util::StreamExt;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let path = socket_path("outside-async");
        let mut rx = Receiver::<Tensor>::bind(&path).unwrap();
        rx.expect_senders(1);
        let tx = Sender::<Tensor>::connect(&path).unwrap();
        let producer = tokio::spawn(async move {
            for i in 0..20u32 {
                let t = Tensor::new(&[i as f32; 16], &[4, 4]).unwrap();
                tx.send_async(&t).await.unwrap();
            }
        });
        let first = tokio::time::timeout(Duration::from_secs(30), rx.recv_async()).await.expect("recv_async hung");
        assert_eq!(first.unwrap().to_vec::<f32>().unwrap(), vec![0.0; 16]);
        let rest: Vec<_> = tokio::time::timeout(Duration::from_secs(60), rx.collect::<Vec<_>>())
            .await
            .expect("Stream did not end after the sender went");
        producer.await.unwrap();
        assert_eq!(rest.len(), 19);
        for (i, t) in rest.into_iter().enumerate() {
            assert_eq!(t.unwrap().to_vec::<f32>().unwrap(), vec![(i + 1) as f32; 16]);
        }
    });
}

#[test]
fn conversions_round_trip_through_a_channel() {
    let path = socket_path("outside-conv");
    let mut rx = Receiver::<Vec<Tensor>>::bind(&path).unwrap();
    let tx = Sender::<Vec<Tensor>>::connect(&path).unwrap();

    let a = Tensor::try_from(vec![1i32, 2, 3]).unwrap();
    assert_eq!(a.shape(), &[3]);
    let b = Tensor::new(&[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    assert_eq!(b.shape(), &[2, 3]);
    let c = Tensor::build::<u8>(&[2, 2], |d| d.copy_from_slice(&[9, 8, 7, 6])).unwrap();
    let h = Tensor::try_from(vec![half::f16::from_f32(1.5), half::f16::from_f32(-2.0)]).unwrap();
    let arr = ndarray::Array2::<f32>::from_shape_fn((3, 2), |(i, j)| (i * 10 + j) as f32);
    let n = Tensor::try_from(&arr).unwrap();
    // A transposed (non-standard-layout) array keeps its logical order.
    let nt = Tensor::try_from(&arr.t()).unwrap();
    assert_eq!(nt.shape(), &[2, 3]);

    // Wrong element count is an error, not a panic.
    assert!(Tensor::new(&[1.0f32, 2.0], &[3]).is_err(), "2 elements for shape [3]");
    // A shape whose product overflows is an error, not a panic.
    let overflow = std::panic::catch_unwind(|| Tensor::new(&[1u8], &[usize::MAX, 2]));
    assert!(matches!(overflow, Ok(Err(_))), "overflowing shape must be an Err");

    tx.send(&vec![a, b, c, h, n, nt]).unwrap();
    let got = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(Vec::<i32>::try_from(&got[0]).unwrap(), vec![1, 2, 3]);
    assert_eq!(Vec::<f64>::try_from(&got[1]).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(Vec::<u8>::try_from(&got[2]).unwrap(), vec![9, 8, 7, 6]);
    assert_eq!(got[3].dtype(), DType::F16);
    assert_eq!(Vec::<half::f16>::try_from(&got[3]).unwrap()[0], half::f16::from_f32(1.5));
    let back = ndarray::ArrayD::<f32>::try_from(&got[4]).unwrap();
    assert_eq!(back, arr.clone().into_dyn());
    let back_t = ndarray::ArrayD::<f32>::try_from(&got[5]).unwrap();
    assert_eq!(back_t, arr.t().to_owned().into_dyn());
    // Asking for the wrong element type is an error.
    assert!(Vec::<f32>::try_from(&got[0]).is_err(), "i32 tensor read as f32");
}

#[test]
fn endpoint_naming_errors_are_errors_and_return_promptly() {
    let bad: Vec<(&str, String)> = vec![
        ("http scheme", "http://localhost:7000".to_string()),
        ("tcp without port", "tcp://localhost".to_string()),
        ("tcp empty host", "tcp://".to_string()),
        ("missing socket dir", "/nonexistent-outside-dir/x.sock".to_string()),
    ];
    for (what, endpoint) in bad {
        let e2 = endpoint.clone();
        let connect = within(Duration::from_secs(30), what, move || Sender::<u32>::connect(e2.as_str()).map(|_| ()));
        assert!(connect.is_err(), "connect({endpoint}) succeeded");
        if endpoint.starts_with("http") || endpoint.starts_with("tcp") {
            let e2 = endpoint.clone();
            let bind = within(Duration::from_secs(30), what, move || Receiver::<u32>::bind(e2.as_str()).map(|_| ()));
            assert!(bind.is_err(), "bind({endpoint}) succeeded");
        }
    }
    // "http://localhost:7000" must not have made a Unix socket under ./http:
    assert!(!std::path::Path::new("http:").exists(), "a URL was taken for a relative path");
    // A path with nothing bound names NoReceiver.
    let missing = socket_path("outside-nobody");
    match Sender::<u32>::connect(&missing) {
        Err(Error::NoReceiver { .. }) => {}
        other => panic!("expected NoReceiver, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn try_send_and_send_timeout_return_within_their_promise_for_a_huge_message() {
    let path = socket_path("outside-nonblock");
    let mut rx = Receiver::<Tensor>::builder().capacity(1).bind(&path).unwrap();
    let tx = Sender::<Tensor>::connect(&path).unwrap();
    let small = Tensor::new(&[1u8; 16], &[16]).unwrap();
    tx.send(&small).unwrap(); // fills the one credit; the receiver does not read
    let big = Tensor::zeros(DType::U8, &[200 << 20]).unwrap();
    let (tx, big) = within(Duration::from_secs(30), "try_send of a 200 MiB message", move || {
        let r = tx.try_send(&big);
        assert!(matches!(r, Err(Error::Full)), "try_send with no credit: {r:?}");
        (tx, big)
    });
    let (tx, big) = within(Duration::from_secs(30), "send_timeout(200 ms) of a 200 MiB message", move || {
        let r = tx.send_timeout(&big, Duration::from_millis(200));
        assert!(matches!(r, Err(Error::Timeout)), "send_timeout with no credit: {r:?}");
        (tx, big)
    });
    // Nothing was lost: the receiver gets the small message, then the big one once there is room.
    assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap().to_vec::<u8>().unwrap(), vec![1u8; 16]);
    tx.send_timeout(&big, Duration::from_secs(30)).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap().shape(), &[200 << 20]);
    assert!(matches!(rx.try_recv(), Err(Error::Empty)), "the refused sends must not have been delivered");
}

#[test]
fn message_info_tells_apart_senders_of_one_process() {
    let path = socket_path("outside-info");
    let mut rx = Receiver::<(u8, u32)>::bind(&path).unwrap();
    let t1 = Sender::<(u8, u32)>::connect(&path).unwrap();
    let t2 = Sender::<(u8, u32)>::connect(&path).unwrap();
    let t3 = t1.clone();
    for i in 1..=3u32 {
        t1.send(&(1, i)).unwrap();
        t2.send(&(2, i)).unwrap();
    }
    t3.send(&(3, 4)).unwrap();
    let mut by_conn: std::collections::HashMap<u64, Vec<(u8, u64)>> = Default::default();
    for _ in 0..7 {
        let (msg, info) = rx.recv_with_info(Some(Duration::from_secs(30))).unwrap();
        assert_eq!(info.sender_pid, std::process::id());
        by_conn.entry(info.connection).or_default().push((msg.0, info.seq));
    }
    assert_eq!(by_conn.len(), 2, "t1 and its clone share a connection; t2 has its own: {by_conn:?}");
    for (_, msgs) in by_conn {
        let who: std::collections::HashSet<u8> = msgs.iter().map(|m| m.0).collect();
        assert!(who == [2].into() || who == [1, 3].into(), "one connection mixes senders: {msgs:?}");
        let seqs: Vec<u64> = msgs.iter().map(|m| m.1).collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "seq numbers each connection from 1");
    }
}

/// What the sender can send.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
enum Wide {
    Known(u32),
    Unknown(String),
}

/// What the receiver can decode: `Wide::Unknown` is not in it.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
enum Narrow {
    Known(u32),
}

#[test]
fn undecodable_message_is_rejected_alone_on_both_sides() {
    let path = socket_path("outside-reject");
    let mut rx = Receiver::<Narrow>::bind(&path).unwrap();
    let tx = Sender::<Wide>::connect(&path).unwrap();
    tx.send(&Wide::Known(1)).unwrap();
    tx.send(&Wide::Unknown("no such variant".into())).unwrap();
    tx.send(&Wide::Known(3)).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap(), Narrow::Known(1));
    match rx.recv_timeout(Duration::from_secs(30)) {
        Err(Error::Rejected { seq, .. }) => assert_eq!(seq, 2),
        other => panic!("expected Error::Rejected for message 2 on the receiver, got {other:?}"),
    }
    assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap(), Narrow::Known(3), "the channel goes on");
    // The sender hears of it too.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut rejected = Vec::new();
    while rejected.is_empty() && std::time::Instant::now() < deadline {
        rejected = tx.take_rejected();
        if rejected.is_empty() {
            // Sending is how a sender reads what the receiver said; a cheap message does.
            let _ = tx.try_send(&Wide::Known(100));
            thread::sleep(Duration::from_millis(50));
        }
    }
    assert_eq!(rejected.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![2], "sender's take_rejected");
}

// ---------------------------------------------------------------------------------------------
// Tests with a second process (`outside-peer`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};

/// The byte pattern the peer uses: element `i` of message `n` is `(i * 31 + n) % 251`.
fn pattern(len: usize, n: u8) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + n as usize) % 251) as u8).collect()
}

/// The peer process, killed if the test ends first.
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Peer {
        // Through the bin directory (IPC_TESTS_BIN_DIR in the GPU bundle), not cargo's build path.
        let mut command = Command::new(integration_tests::bin_path("outside-peer").expect("outside-peer's path"));
        command.args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("start outside-peer");
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Peer { child, lines }
    }

    /// The next line the peer prints, within a generous bound.
    fn line(&self) -> String {
        self.lines.recv_timeout(Duration::from_secs(120)).expect("the peer said nothing within 120 s")
    }

    /// Every line until the peer exits.
    fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(120)) {
            out.push(line);
        }
        out
    }

    fn write_line(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn wait_success(&mut self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "peer failed: {status}");
                return;
            }
            assert!(std::time::Instant::now() < deadline, "peer did not exit within 120 s");
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn received_host_memory_stays_read_only_against_the_receivers_own_syscalls() {
    let path = socket_path("outside-ro");
    let len = 1 << 20;
    let mut peer = Peer::start(&["attack-ro", path.to_str().unwrap(), &len.to_string()], &[]);
    assert_eq!(peer.line(), "bound");
    let tx = Sender::<Tensor>::connect(&path).unwrap();
    let mine = Tensor::new(&pattern(len, 5), &[len]).unwrap();
    tx.send(&mine).unwrap();
    let report = peer.rest();
    peer.wait_success();
    let broken: Vec<&String> = report.iter().filter(|l| l.ends_with(" ok") && !l.starts_with("fchmod")).collect();
    assert!(broken.is_empty(), "the receiver could write the sender's memory: {broken:?} (all: {report:?})");
    assert!(
        report.iter().any(|l| l.starts_with("mmap-shared-write") || l.starts_with("open-rdwr")),
        "the peer found no memfd to attack: {report:?}"
    );
    assert!(report.iter().any(|l| l == "intact"), "{report:?}");
    assert_eq!(mine.to_vec::<u8>().unwrap(), pattern(len, 5), "the sender's own tensor changed");
}

#[test]
fn messages_of_a_sender_killed_before_the_receiver_looked_still_arrive_whole() {
    let path = socket_path("outside-died");
    let mut rx = Receiver::<Tensor>::bind(&path).unwrap();
    rx.expect_senders(1);
    let mut peer = Peer::start(&["send-and-die", path.to_str().unwrap(), "5"], &[]);
    let status = peer.child.wait().unwrap();
    assert!(!status.success(), "the peer killed itself");
    let got: Vec<_> = within(Duration::from_secs(60), "iterating a dead sender's messages", move || {
        let items: Vec<_> = rx.iter().collect();
        (items, rx.take_errors())
    })
    .0;
    assert_eq!(got.len(), 5, "a dead sender's complete messages are delivered");
    for (n, item) in got.into_iter().enumerate() {
        let t = item.unwrap_or_else(|e| panic!("message {n}: {e}"));
        assert_eq!(t.to_vec::<u8>().unwrap(), pattern(1 << 20, n as u8), "message {n}'s bytes");
    }
}

#[test]
fn two_processes_each_sending_a_large_message_first_do_not_deadlock_unix() {
    let mine = socket_path("outside-bigfirst-a");
    let theirs = socket_path("outside-bigfirst-b");
    big_first(mine.to_str().unwrap(), theirs.to_str().unwrap(), 96 << 20, &[]);
}

#[test]
fn two_processes_each_sending_a_large_message_first_do_not_deadlock_tcp() {
    let secret = "outside-tester-secret-0123456789";
    big_first("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 96 << 20, &[("TQ_SECRET", secret)]);
}

/// This process and the peer each bind a receiver, send `len` bytes to the other first, then
/// receive.
fn big_first(mine: &str, theirs: &str, len: usize, env: &[(&str, &str)]) {
    let tcp = mine.starts_with("tcp://");
    let mut builder = Receiver::<Tensor>::builder();
    if tcp {
        builder = builder.secret(tensor_queue::Secret::from_bytes(*b"outside-tester-secret-0123456789").unwrap());
    }
    let mut rx = builder.bind(mine).unwrap();
    let my_endpoint = match rx.local_addr() {
        Some(addr) => format!("tcp://127.0.0.1:{}", addr.port()),
        None => mine.to_string(),
    };
    let mut peer = Peer::start(&["big-first", theirs, &my_endpoint, &len.to_string()], env);
    let first = peer.line();
    let their_endpoint = match first.strip_prefix("port ") {
        Some(port) => format!("tcp://127.0.0.1:{port}"),
        None => theirs.to_string(),
    };
    peer.write_line(&my_endpoint);
    let mut connect = Sender::<Tensor>::builder();
    if tcp {
        connect = connect.secret(tensor_queue::Secret::from_bytes(*b"outside-tester-secret-0123456789").unwrap());
    }
    let tx = connect.connect(their_endpoint.as_str()).unwrap();
    let big = Tensor::new(&pattern(len, 3), &[len]).unwrap();
    let (got, tx) = within(Duration::from_secs(240), "send big first, then receive", move || {
        tx.send(&big).unwrap();
        (rx.recv_timeout(Duration::from_secs(200)).map(|t| t.to_vec::<u8>().unwrap()), tx)
    });
    assert!(got.unwrap() == pattern(len, 2), "the peer's bytes");
    assert_eq!(peer.line(), "sent");
    assert_eq!(peer.line(), "received");
    peer.wait_success();
    drop(tx);
}

// ---------------------------------------------------------------------------------------------
// TCP: secrets, silent connectors, killed senders, non-blocking sends of large messages.

const SECRET: &[u8; 32] = b"outside-tester-secret-0123456789";

fn secret() -> tensor_queue::Secret {
    tensor_queue::Secret::from_bytes(*SECRET).unwrap()
}

/// A TCP receiver on a free loopback port, and its endpoint.
fn tcp_receiver<T: serde::de::DeserializeOwned>(capacity: u32) -> (Receiver<T>, String) {
    let rx = Receiver::<T>::builder().capacity(capacity).secret(secret()).bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", rx.local_addr().unwrap().port());
    (rx, endpoint)
}

fn tcp_sender<T: Serialize>(endpoint: &str) -> tensor_queue::Result<Sender<T>> {
    Sender::<T>::builder().secret(secret()).timeout(Duration::from_secs(60)).connect(endpoint)
}

#[test]
fn silent_tcp_connectors_do_not_lock_out_an_honest_sender() {
    let (mut rx, endpoint) = tcp_receiver::<u32>(4);
    let addr = endpoint.trim_start_matches("tcp://").to_string();
    // 200 connections that never say a word, held open for the whole test.
    let silent: Vec<std::net::TcpStream> = (0..200).filter_map(|_| std::net::TcpStream::connect(&addr).ok()).collect();
    assert!(silent.len() >= 100, "could not open the silent connections");
    let e2 = endpoint.clone();
    let tx = within(Duration::from_secs(60), "an honest connect among silent ones", move || tcp_sender::<u32>(&e2))
        .expect("the honest sender was kept out");
    tx.send(&42).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), 42);
    // More silent ones after the honest one joined do not cut it off.
    let more: Vec<std::net::TcpStream> = (0..100).filter_map(|_| std::net::TcpStream::connect(&addr).ok()).collect();
    tx.send(&43).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), 43);
    // Shed handshakes are never blamed on the secret.
    let errors = rx.take_errors();
    assert!(
        !errors.iter().any(|e| e.to_string().to_lowercase().contains("auth")),
        "silent connectors were reported as failing authentication: {errors:?}"
    );
    drop((silent, more));
}

#[test]
fn tcp_try_send_of_a_large_message_returns_at_once_when_the_receiver_does_not_read() {
    // Watchdog: this test was seen to hang its test thread past every bound below (not in a
    // thread of `within`); the binary then fails rather than hangs.
    thread::spawn(|| {
        thread::sleep(Duration::from_secs(240));
        eprintln!("tcp_try_send_of_a_large_message...: still not done after 240 s: HANG (broken promise)");
        std::process::exit(101);
    });
    let (rx, endpoint) = tcp_receiver::<Tensor>(4);
    // Leaked: when a send hangs, the test must fail at its bound, not hang in the receiver's drop.
    let rx: &'static mut Receiver<Tensor> = Box::leak(Box::new(rx));
    let tx = tcp_sender::<Tensor>(&endpoint).unwrap();
    let len = 512usize << 20;
    let big = Tensor::zeros(DType::U8, &[len as u64]).unwrap();
    // The receiver reads nothing now: the first large message fills the socket; the next ones
    // must still come back within their promise (Ok queued, or Full), never wait for the reader.
    let tx = within(Duration::from_secs(60), "TCP try_send of 512 MiB messages, receiver not reading", move || {
        for i in 0..3 {
            eprintln!("try_send {i}");
            match tx.try_send(&big) {
                Ok(()) | Err(Error::Full) => {}
                Err(e) => panic!("try_send: {e}"),
            }
        }
        tx
    });
    let tx = within(Duration::from_secs(60), "TCP send_timeout(100 ms) of a 512 MiB message", move || {
        let small = Tensor::zeros(DType::U8, &[len as u64]).unwrap();
        match tx.send_timeout(&small, Duration::from_millis(100)) {
            Ok(()) | Err(Error::Timeout) | Err(Error::Full) => {}
            Err(e) => panic!("send_timeout: {e}"),
        }
        tx
    });
    // Whatever was accepted arrives whole, and recv_timeout keeps its own bound.
    let first = within(Duration::from_secs(150), "recv_timeout(60 s) of the first accepted message", move || {
        rx.recv_timeout(Duration::from_secs(60)).map(|t| t.shape().to_vec())
    });
    assert_eq!(first.unwrap(), vec![len as u64]);
    drop(tx);
}

#[test]
fn a_tcp_sender_killed_mid_message_leaves_an_entry_in_take_errors() {
    let (mut rx, endpoint) = tcp_receiver::<Tensor>(4);
    let len = 1usize << 30;
    let mut peer =
        Peer::start(&["send-big", &endpoint, &len.to_string()], &[("TQ_SECRET", "outside-tester-secret-0123456789")]);
    assert_eq!(peer.line(), "sending");
    // Kill it once it has written at least 1 MiB to its sockets (the kernel's count of bytes
    // written, /proc/PID/io `wchar`): the message has started, and 1 GiB cannot be done. Counted
    // from 0, not from when "sending" was read: this receiver reads nothing yet, so the sender
    // may have filled the socket's buffers (several MiB) before then and write nothing more.
    let io = format!("/proc/{}/io", peer.child.id());
    let wchar = || -> u64 {
        let text = std::fs::read_to_string(&io).unwrap_or_default();
        text.lines().find_map(|l| l.strip_prefix("wchar: ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while wchar() < 1 << 20 {
        assert!(std::time::Instant::now() < deadline, "the peer never started writing its message");
        thread::sleep(Duration::from_millis(1));
    }
    peer.sigkill();
    let (result, errors) = within(Duration::from_secs(120), "recv after the sender died mid-message", move || {
        let result = rx.recv_timeout(Duration::from_secs(30)).map(|t| t.shape().to_vec());
        let mut errors = rx.take_errors();
        if errors.is_empty() {
            // The loss may be noticed on the next look.
            let _ = rx.recv_timeout(Duration::from_secs(5));
            errors = rx.take_errors();
        }
        (result, errors)
    });
    assert!(result.is_err(), "a message whose sender died mid-way was delivered: {result:?}");
    let text: Vec<String> = errors.iter().map(|e| format!("{e} / {e:?}")).collect();
    assert!(
        errors.iter().any(|e| matches!(e, Error::ConnectionClosed { .. }) && format!("{e:?}").contains("Unfinished")),
        "take_errors must report the lost message (ConnectionClosed caused by Unfinished): {text:?}; recv said {result:?}"
    );
}

#[test]
fn a_slow_tcp_consumer_only_slows_its_sender() {
    let (mut rx, endpoint) = tcp_receiver::<Tensor>(2);
    let tx = tcp_sender::<Tensor>(&endpoint).unwrap();
    let producer = thread::spawn(move || {
        for n in 0..6u8 {
            tx.send(&Tensor::new(&pattern(16 << 20, n), &[16 << 20]).unwrap()).unwrap();
        }
        tx
    });
    for n in 0..6u8 {
        // Slower than the sender: it must wait, not be cut.
        thread::sleep(Duration::from_millis(700));
        let t = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert_eq!(t.to_vec::<u8>().unwrap(), pattern(16 << 20, n), "message {n}");
    }
    let tx = producer.join().unwrap();
    assert!(tx.is_connected(), "the slow consumer's sender was disconnected");
    assert!(rx.take_errors().is_empty());
}

#[test]
fn a_receiver_out_of_descriptors_rejects_alone_and_goes_on() {
    let path = socket_path("outside-fds");
    // The peer keeps 6 spare descriptors and holds every tensor it receives; each 64 MiB tensor
    // needs a chunk of its own (a descriptor of its own).
    let mut peer = Peer::start(&["fd-starved", path.to_str().unwrap(), "6", "12"], &[]);
    assert_eq!(peer.line(), "bound");
    let tx = Sender::<Tensor>::connect(&path).unwrap();
    let len = 48usize << 20;
    for n in 0..12u8 {
        tx.send_timeout(&Tensor::new(&pattern(len, n), &[len]).unwrap(), Duration::from_secs(60)).unwrap();
    }
    // The next message goes once the peer let go of what it held and raised its limit again,
    // as the refusal told it to (a chunk announced again then finds a descriptor free; one read
    // ahead while none were would be refused with it).
    let mut report = Vec::new();
    while !report.last().is_some_and(|l: &String| l.starts_with("held ")) {
        report.push(peer.line());
    }
    let rejected: Vec<String> = report.iter().filter(|l| l.starts_with("rejected ")).cloned().collect();
    assert!(!rejected.is_empty(), "with 6 spare descriptors, 12 chunks cannot all be held: {report:?}");
    // The refusals reach the sender's reader thread after the peer printed them: gather them
    // until all came (a bounded wait; a missing one fails below). A lost chunk's notice
    // (`ChunkLost`) travels ahead of the refusal of the first message that used it, so once every
    // refusal is in, the sender knows which chunks to announce again. (A message sent before the
    // notice arrived would be refused too: the receiver cannot map what it never got.)
    let mut sender_side = tx.take_rejected();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while sender_side.len() < rejected.len() && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
        sender_side.extend(tx.take_rejected());
    }
    assert_eq!(sender_side.len(), rejected.len(), "the sender hears of each refusal: {sender_side:?}");
    // A tensor whose chunk the peer lost is announced again before this message.
    tx.send_timeout(&Tensor::new(&pattern(len, 99), &[len]).unwrap(), Duration::from_secs(60)).unwrap();
    report.extend(peer.rest());
    let summary = report.iter().find(|l| l.starts_with("held ")).cloned().unwrap_or_default();
    assert!(summary.contains("other []"), "only messages are refused, the channel stays: {report:?}");
    let after = format!("after {len}");
    assert!(report.contains(&after), "after letting go, the channel goes on: {report:?}");
    assert!(tx.take_rejected().is_empty(), "the message after letting go was refused");
    assert!(
        rejected.iter().all(|r| r.to_lowercase().contains("descriptor") || r.contains("limit")),
        "the refusal names the limit: {rejected:?}"
    );
    peer.wait_success();
}

/// The postcard bytes of a chain of `depth` `Tree::Node`s (the peer's recursive type), each the
/// only child of the one above, around a leaf: written out, as a hostile or careless peer would
/// (serializing so deep a value would recurse as deep).
struct Chain(usize);

impl serde::Serialize for Chain {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut bytes = [1u8, 1].repeat(self.0); // variant Node, a Vec of one
        bytes.extend([0, 7]); // Leaf(7)
        let mut tuple = serializer.serialize_tuple(bytes.len())?; // postcard: the bytes as they are
        for byte in bytes {
            tuple.serialize_element(&byte)?;
        }
        tuple.end()
    }
}

#[test]
fn a_receiver_of_a_recursive_type_refuses_a_message_nested_too_deep_and_goes_on() {
    // Decoding recurses once per level; a few hundred KiB nesting 200,000 levels overflowed the
    // receiving thread's stack, which aborts the whole process.
    let path = socket_path("outside-deep");
    let mut peer = Peer::start(&["tree", path.to_str().unwrap(), "3"], &[]);
    assert_eq!(peer.line(), "bound");
    let tx = Sender::<Chain>::connect(&path).unwrap();
    for depth in [5, 200_000, 120] {
        tx.send_timeout(&Chain(depth), Duration::from_secs(60)).unwrap();
    }
    let report = peer.rest();
    assert_eq!(report.len(), 3, "the peer reports every message: {report:?}");
    assert_eq!(report[0], "depth 5");
    assert!(report[1].starts_with("refused ") && report[1].contains("nests deeper than"), "{report:?}");
    assert_eq!(report[2], "depth 120", "the next message arrives (120 nodes, 241 levels, are allowed)");
    peer.wait_success();
    let mut refused = tx.take_rejected();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while refused.is_empty() && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
        refused = tx.take_rejected();
    }
    assert_eq!(refused.len(), 1, "the sender hears of the refusal: {refused:?}");
}

#[test]
fn a_sender_refuses_a_message_nested_deeper_than_a_receiver_takes() {
    #[derive(Serialize, Deserialize)]
    enum Tree {
        Leaf,
        Node(Vec<Tree>),
    }
    let chain = |depth: usize| (0..depth).fold(Tree::Leaf, |tree, _| Tree::Node(vec![tree]));
    let path = socket_path("outside-deep-send");
    let mut rx = Receiver::<Tree>::bind(&path).unwrap();
    let tx = Sender::<Tree>::connect(&path).unwrap();
    // Two levels a node (its variant, its Vec), one the leaf: 127 nodes are the most.
    match tx.send(&chain(128)) {
        Err(Error::Encode(reason)) => assert!(reason.contains("nests deeper than"), "{reason}"),
        other => panic!("a message its receiver would refuse was sent: {other:?}"),
    }
    tx.send(&chain(127)).unwrap();
    let mut depth = 0;
    let mut tree = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    while let Tree::Node(mut children) = tree {
        (tree, depth) = (children.pop().unwrap(), depth + 1);
    }
    assert_eq!(depth, 127);
}
