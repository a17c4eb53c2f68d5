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

/// Serialized how many times (a message whose encoding is costly, to a queue that is full).
static ENCODED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[derive(serde::Deserialize)]
struct Costly(u32);

impl serde::Serialize for Costly {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ENCODED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        serializer.serialize_newtype_struct("Costly", &self.0)
    }
}

/// A full queue refuses `try_send` and a send that may not wait (`send_timeout` of zero, also a
/// broadcast's) before the message is encoded, and `has_room` says so first.
#[test]
fn try_send_to_a_full_queue_refuses_before_encoding() {
    let path = socket_path("round9-try-send");
    let mut rx = Receiver::<Costly>::bind_with_capacity(&path, 1).unwrap();
    let tx = Sender::<Costly>::connect(&path).unwrap();
    tx.wait_ready(Duration::from_secs(30)).unwrap();
    assert!(tx.has_room());
    tx.try_send(&Costly(1)).unwrap();
    assert!(!tx.has_room());
    let before = ENCODED.load(std::sync::atomic::Ordering::Relaxed);
    for _ in 0..100 {
        assert!(matches!(tx.try_send(&Costly(2)), Err(Error::Full)));
        assert!(matches!(tx.send_timeout(&Costly(2), Duration::ZERO), Err(Error::Timeout)));
    }
    let both = tensor_queue::Broadcast::new(vec![tx.clone()]);
    assert!(matches!(both.send_timeout(&Costly(2), Duration::ZERO), Err(Error::Timeout)));
    assert_eq!(ENCODED.load(std::sync::atomic::Ordering::Relaxed), before, "refused tries encoded the message");
    assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap().0, 1);
    within(Duration::from_secs(30), "room after a receive", move || {
        while !tx.has_room() {
            thread::sleep(Duration::from_millis(1));
        }
        tx.try_send(&Costly(3)).unwrap();
        tx
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap().0, 3);
}

/// A program started by a spawned child after it took its channel finds no channel: neither
/// `is_spawned_child` (the variable is inherited, the socket is not) nor `from_parent`, which
/// says why with a typed error rather than the descriptor's raw failure.
#[test]
fn a_grandchild_of_spawn_finds_no_channel_once_the_child_took_it() {
    const NAME: &str = "a_grandchild_of_spawn_finds_no_channel_once_the_child_took_it";
    const ROLE: &str = "ROUND9_SPAWN_ROLE";
    // The harness prints "test NAME ... " ahead of what the test prints on the same line.
    let verdict = |said: &str| {
        said.find("grandchild:")
            .map_or("no verdict".to_string(), |at| said[at..].lines().next().unwrap_or("").to_string())
    };
    let exe = std::env::current_exe().unwrap();
    let rerun = |role: &str| {
        let mut command = std::process::Command::new(&exe);
        command.args([NAME, "--exact", "--nocapture", "--test-threads=1"]).env(ROLE, role);
        command
    };
    match std::env::var(ROLE).as_deref() {
        Ok("child") => {
            let mut from_parent = tensor_queue::from_parent::<String>().unwrap();
            let output = rerun("grandchild").output().unwrap();
            let said = String::from_utf8_lossy(&output.stdout);
            let asked = from_parent.recv_timeout(Duration::from_secs(30)).unwrap();
            assert_eq!(asked, "report");
            println!("{}", verdict(&said));
        }
        Ok("grandchild") => {
            let spawned = tensor_queue::is_spawned_child();
            let taken = tensor_queue::from_parent::<String>();
            let typed = matches!(taken, Err(Error::NoParentChannel(_)));
            println!("grandchild: spawned={spawned} typed={typed} {:?}", taken.err());
        }
        _ => {
            let (child, to_child) =
                tensor_queue::spawn::<String>(rerun("child").stdout(std::process::Stdio::piped())).unwrap();
            to_child.send_timeout(&"report".to_string(), Duration::from_secs(60)).unwrap();
            let output =
                within(Duration::from_secs(120), "the child and grandchild", move || child.wait_with_output().unwrap());
            let said = String::from_utf8_lossy(&output.stdout);
            let verdict = verdict(&said);
            assert!(verdict.starts_with("grandchild: spawned=false typed=true"), "{verdict}\n{said}");
        }
    }
}

/// A copy into an expanded view (stride 0) would write one element many times (on a GPU, racing
/// threads): refused, as torch's `copy_` refuses it, with the destination unchanged. A layout
/// whose strides do not match its dimensions says so, not that there are too many.
#[test]
fn a_copy_into_a_view_whose_elements_share_memory_is_refused() {
    use tensor_queue::{DType, Tensor, TensorProblem};
    let target = Tensor::zeros(DType::I32, &[1, 2, 3, 4]).unwrap();
    let expanded = target.expand(&[5, 2, 3, 4]).unwrap();
    let source = Tensor::from_slice(&(0..120).collect::<Vec<i32>>(), DType::I32, &[5, 2, 3, 4]).unwrap();
    let result = source.copy_into(&expanded);
    assert!(matches!(result, Err(Error::Tensor(TensorProblem::AliasedDestination { .. }))), "{result:?}");
    assert_eq!(target.to_vec::<i32>().unwrap(), vec![0; 24], "the destination is unchanged");
    // A plain destination of the same shape takes the copy.
    let plain = Tensor::zeros(DType::I32, &[5, 2, 3, 4]).unwrap();
    source.copy_into(&plain).unwrap();
    assert_eq!(plain.to_vec::<i32>().unwrap(), (0..120).collect::<Vec<i32>>());
    let mismatched = target.as_layout(DType::I32, &[2, 3], &[1], 0).unwrap_err().to_string();
    assert!(mismatched.contains("one stride per dimension") && !mismatched.contains("at most"), "{mismatched}");
}

/// Endpoints no connection can be made to are refused as such, before any system call.
#[test]
fn endpoints_with_a_nul_byte_or_malformed_ipv6_brackets_are_bad_endpoints() {
    use tensor_queue::EndpointProblem;
    let nul = Sender::<u32>::connect("/tmp/round9\0nul.sock").err();
    assert!(matches!(nul, Some(Error::BadEndpoint { problem: EndpointProblem::NulByte, .. })), "{nul:?}");
    let bound = Receiver::<u32>::bind("/tmp/round9\0nul.sock").err();
    assert!(matches!(bound, Some(Error::BadEndpoint { problem: EndpointProblem::NulByte, .. })), "{bound:?}");
    for bad in ["tcp://[::1:4000", "tcp://[::1]x:4000", "tcp://[::1]]:4000", "tcp://[]:4000"] {
        let bracket = Sender::<u32>::connect(bad).err();
        assert!(
            matches!(bracket, Some(Error::BadEndpoint { problem: EndpointProblem::Ipv6Brackets, .. })),
            "{bad}: {bracket:?}"
        );
    }
    let nul = Receiver::<u32>::bind("tcp://[::1\0]:4000").err();
    assert!(matches!(nul, Some(Error::BadEndpoint { problem: EndpointProblem::NulByte, .. })), "{nul:?}");
    // A well-formed IPv6 endpoint passes the check (and binds where the machine has IPv6).
    let v6 = Receiver::<u32>::bind("tcp://[::1]:0");
    assert!(!matches!(v6, Err(Error::BadEndpoint { .. })), "{:?}", v6.err());
}
