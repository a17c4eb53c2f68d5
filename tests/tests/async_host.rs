//! The async API (feature `tokio`) under a multi-threaded runtime, with real processes on the
//! other end: many channels at once, a sender killed mid-stream, a receiver killed while a send
//! waits for credit.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures_util::StreamExt;
use integration_tests::queue::{Probe, checksum, probe};
use integration_tests::{bin_path, socket_path, stdout_lines};
use tensor_queue::{Error, Receiver};

/// `tq-peer send`: connects to `path` and sends `count` probes.
fn sender_process(path: &std::path::Path, count: u32, seed: u64) -> Child {
    Command::new(bin_path("tq-peer").unwrap())
        .args(["send", "--count", &count.to_string(), "--seed", &seed.to_string(), "--to"])
        .arg(path)
        .spawn()
        .unwrap()
}

/// A minute is "never" here: these bound a hang, they do not measure anything.
const NEVER: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_channels_fed_by_processes_are_received_as_streams() {
    const CHANNELS: usize = 12;
    let mut tasks = Vec::new();
    let mut children = Vec::new();
    for k in 0..CHANNELS {
        let path = socket_path("async-many");
        let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
        receiver.expect_senders(1);
        children.push(sender_process(&path, 5 + k as u32, k as u64));
        tasks.push(tokio::spawn(async move {
            let mut received = 0;
            // Alternate the two ways in: the stream and recv_async.
            while let Some(probe) = if k % 2 == 0 {
                receiver.next().await
            } else {
                match receiver.recv_async().await {
                    Err(Error::Disconnected) => None,
                    other => Some(other),
                }
            } {
                let probe = probe.unwrap();
                assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0]);
                received += 1;
            }
            received
        }));
    }
    for (k, task) in tasks.into_iter().enumerate() {
        let received = tokio::time::timeout(NEVER, task).await.expect("a channel never ended").unwrap();
        assert_eq!(received, 5 + k, "channel {k}");
    }
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_killed_mid_stream_ends_the_stream_and_spares_the_other_channels() {
    let doomed_path = socket_path("async-doomed");
    let healthy_path = socket_path("async-healthy");
    let mut doomed = Receiver::<Probe>::bind(&doomed_path).unwrap();
    let mut healthy = Receiver::<Probe>::bind(&healthy_path).unwrap();
    doomed.expect_senders(1);
    healthy.expect_senders(1);
    let mut killer = sender_process(&doomed_path, 1_000_000, 3);
    let healthy_task = tokio::spawn(async move {
        let mut child = sender_process(&healthy_path, 20, 4);
        let mut n = 0;
        while let Some(probe) = healthy.next().await {
            probe.unwrap();
            n += 1;
        }
        assert!(child.wait().unwrap().success());
        n
    });
    let mut received = 0;
    let ended = tokio::time::timeout(NEVER, async {
        while let Some(probe) = doomed.next().await {
            let probe = probe.unwrap();
            assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0]);
            received += 1;
            if received == 5 {
                killer.kill().unwrap(); // SIGKILL, while it is sending
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the stream of a killed sender never ended ({received} received)");
    assert!(received >= 5);
    assert!(matches!(doomed.recv_async().await, Err(Error::Disconnected)));
    killer.wait().unwrap();
    assert_eq!(tokio::time::timeout(NEVER, healthy_task).await.expect("the healthy channel hung").unwrap(), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_async_feeds_a_receiving_process_through_its_credits() {
    let mut command = Command::new(bin_path("tq-user").unwrap());
    command.arg("count").stdout(Stdio::piped());
    let (mut child, sender) = tensor_queue::spawn::<Probe>(&mut command).unwrap();
    let lines = stdout_lines(&mut child, Some("tq-user count".into()));
    // More than the capacity (16): later sends wait for credits the child returns.
    for i in 0..100 {
        let message = probe(i, i, 4096, None).unwrap();
        tokio::time::timeout(NEVER, sender.send_async(&message)).await.expect("send_async hung").unwrap();
    }
    drop(sender);
    let line = tokio::task::spawn_blocking(move || lines.recv_timeout(NEVER)).await.unwrap().unwrap();
    assert_eq!(line, "disconnected after 100 bad 0");
    assert!(child.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_waiting_for_credit_ends_when_the_receiving_process_is_killed() {
    let mut command = Command::new(bin_path("tq-user").unwrap());
    command.args(["hold", "--count", "2"]).stdout(Stdio::piped());
    let (mut child, sender) = tensor_queue::spawn::<Probe>(&mut command).unwrap();
    let lines = stdout_lines(&mut child, Some("tq-user hold".into()));
    // It takes two and then never receives again: once its credits are spent, sends wait. The
    // killer waits until it holds them, and lets the sends run into the wait first.
    let pid = rustix::process::Pid::from_child(&child);
    let killer = std::thread::spawn(move || {
        let line = lines.recv_timeout(NEVER).unwrap();
        assert!(line.starts_with("holding"), "{line}");
        std::thread::sleep(Duration::from_millis(200));
        rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    });
    let outcome = tokio::time::timeout(NEVER, async {
        for i in 0..1000 {
            if let Err(error) = sender.send_async(&probe(i, i, 64, None).unwrap()).await {
                return (i, error);
            }
        }
        panic!("a thousand sends to a receiver that took two went through");
    })
    .await
    .expect("a send to a killed receiver hung");
    killer.join().unwrap();
    assert!(matches!(outcome.1, Error::Disconnected), "{outcome:?}");
    child.wait().unwrap();
}
