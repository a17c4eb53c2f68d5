//! Round 9 of the outside tests (Rust): what an outside tester found with only the README and
//! the API docs, as tests of the public API. Every wait is bounded; no bound is a speed assertion.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use integration_tests::{socket_path, within};
use tensor_queue::{Error, Receiver, Sender};

/// Three senders connect at the same moment to a receiver that expects two, 20 rounds: the one
/// beyond is turned away at connect, and every message a `send` accepted arrives.
#[test]
fn expect_senders_turns_away_a_sender_beyond_the_count_even_at_once_and_loses_nothing() {
    for round in 0..20 {
        let path = socket_path("round9-expect");
        let mut rx = Receiver::<(u32, u32)>::bind(&path).unwrap();
        rx.expect_senders(2);
        let barrier = Arc::new(Barrier::new(3));
        let senders: Vec<_> = (0..3u32)
            .map(|who| {
                let (path, barrier) = (path.clone(), barrier.clone());
                thread::spawn(move || {
                    barrier.wait();
                    let tx = match Sender::<(u32, u32)>::connect(&path) {
                        Ok(tx) => tx,
                        Err(error) => return (who, 0, Some(error)),
                    };
                    if who == 2 {
                        thread::sleep(Duration::from_millis(50)); // the slow one of the three
                    }
                    let mut accepted = 0;
                    for n in 0..50 {
                        match tx.send_timeout(&(who, n), Duration::from_secs(30)) {
                            Ok(()) => accepted += 1,
                            Err(error) => return (who, accepted, Some(error)),
                        }
                    }
                    (who, accepted, None)
                })
            })
            .collect();
        let mut delivered = [0u32; 3];
        let received = within(Duration::from_secs(120), "the receiver's stream", move || {
            for message in rx.iter() {
                let (who, n) = message.unwrap();
                assert_eq!(n, delivered[who as usize], "sender {who}'s messages in order");
                delivered[who as usize] += 1;
            }
            delivered
        });
        let outcomes: Vec<_> = senders.into_iter().map(|s| s.join().unwrap()).collect();
        // Turned away: refused by the receiver (`PeerRefused`); or, once the count was reached
        // and the receiver stopped listening, nobody there (`NoReceiver`), or a connection dropped
        // before its greeting (`Disconnected` at the first send). Never after a `send` accepted.
        let refused: Vec<_> =
            outcomes.iter().filter(|(_, accepted, error)| *accepted == 0 && error.is_some()).collect();
        assert_eq!(refused.len(), 1, "round {round}: one of three is turned away: {outcomes:?}");
        assert!(
            matches!(refused[0].2, Some(Error::PeerRefused(_) | Error::NoReceiver { .. } | Error::Disconnected)),
            "round {round}: turned away at connect: {outcomes:?}"
        );
        for (who, accepted, error) in &outcomes {
            assert_eq!(
                received[*who as usize], *accepted,
                "round {round}: sender {who}'s accepted messages all arrive ({error:?}; {outcomes:?})"
            );
        }
    }
}

#[test]
fn expect_senders_of_zero_ends_the_stream_at_once() {
    let path = socket_path("round9-expect-zero");
    let mut rx = Receiver::<u32>::bind(&path).unwrap();
    rx.expect_senders(0);
    let (result, mut rx) = within(Duration::from_secs(30), "recv after expect_senders(0)", move || {
        let result = rx.recv_timeout(Duration::from_secs(20));
        (result, rx)
    });
    assert!(matches!(result, Err(Error::Disconnected)), "{result:?}");
    assert_eq!(rx.iter().count(), 0);
}

/// A spin longer than a `send_timeout`'s timeout does not put it off; a spin of `Duration::MAX`
/// neither (nor does it overflow the clock) on either side.
#[test]
fn a_long_spin_never_outlasts_a_timeout_on_either_side() {
    let path = socket_path("round9-spin");
    let mut rx = Receiver::<u32>::builder().capacity(1).bind(&path).unwrap();
    let tx = Sender::<u32>::connect(&path).unwrap();
    tx.send(&0).unwrap(); // the one credit
    for spin in [Duration::from_secs(3600), Duration::MAX] {
        let tx = tx.clone();
        let (result, took) = within(Duration::from_secs(60), "send_timeout under a long spin", move || {
            tx.set_spin(spin);
            let start = Instant::now();
            (tx.send_timeout(&1, Duration::from_millis(200)), start.elapsed())
        });
        assert!(matches!(result, Err(Error::Timeout)), "spin {spin:?}: {result:?}");
        assert!(took < Duration::from_secs(30), "spin {spin:?}: send_timeout(200 ms) took {took:?}");
    }
    tx.set_spin(Duration::ZERO);
    rx.set_spin(Duration::MAX);
    let (rx, first, empty) = within(Duration::from_secs(60), "recv_timeout under a spin of Duration::MAX", move || {
        let first = rx.recv_timeout(Duration::from_millis(200));
        let empty = rx.recv_timeout(Duration::from_millis(200));
        (rx, first, empty)
    });
    assert_eq!(first.unwrap(), 0);
    assert!(matches!(empty, Err(Error::Timeout)), "{empty:?}");
    drop(rx);
}

/// `recv_async` in a runtime built without IO is no runtime it can use: a typed error, not
/// tokio's panic; the message stays for a receive that can take it.
#[test]
fn recv_async_in_a_runtime_without_io_is_no_runtime_not_a_panic() {
    let path = socket_path("round9-no-io");
    let mut rx = Receiver::<u32>::bind(&path).unwrap();
    let tx = Sender::<u32>::connect(&path).unwrap();
    tx.send(&7).unwrap();
    let no_io = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let result = no_io.block_on(rx.recv_async());
    assert!(matches!(result, Err(Error::NoRuntime)), "{result:?}");
    assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap(), 7);
}

/// One runtime per task (or per test) is common: `recv_async` keeps working in a new runtime
/// after the one it first ran in was dropped.
#[test]
fn recv_async_works_in_a_second_runtime_after_the_first_was_dropped() {
    let path = socket_path("round9-runtimes");
    let mut rx = Receiver::<u32>::bind(&path).unwrap();
    let tx = Sender::<u32>::connect(&path).unwrap();
    for n in 0..3u32 {
        tx.send(&n).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let got = runtime.block_on(async { tokio::time::timeout(Duration::from_secs(30), rx.recv_async()).await });
        assert_eq!(got.expect("recv_async timed out").unwrap(), n, "runtime {n}");
        drop(runtime);
    }
}

/// A live server of another socket type at the path (a stream server's) is not a stale socket
/// file: bind refuses, and the server keeps its file and its clients.
#[test]
fn bind_refuses_a_path_where_a_stream_server_listens() {
    let path = socket_path("round9-stream-server");
    let server = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let result = Receiver::<u32>::bind(&path);
    assert!(result.is_err(), "bind took over a live stream server's socket file");
    let text = result.err().unwrap().to_string();
    assert!(text.contains("in use"), "{text}");
    let _client = std::os::unix::net::UnixStream::connect(&path).expect("the server's clients still reach it");
    assert!(server.accept().is_ok());
    drop(server);
    std::fs::remove_file(&path).unwrap();
    // Nobody listens now: a socket file left behind is stale, and bind replaces it.
    let stale = std::os::unix::net::UnixListener::bind(&path).unwrap();
    drop(stale);
    assert!(Receiver::<u32>::bind(&path).is_ok());
}
