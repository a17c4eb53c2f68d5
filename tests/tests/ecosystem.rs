//! What users of crossbeam-channel, flume, ipc-channel and tokio reach for, tried as an outside
//! program would: iteration, waiting on several receivers, and naming mistakes. The senders are
//! other processes (`tq-peer send`).

use std::process::{Child, Command};

use integration_tests::queue::{Probe, checksum};
use integration_tests::{bin_path, socket_path};
use tensor_queue::{Error, Receiver};

/// `tq-peer send`: connects to `path`, sends `count` probes, and exits (or aborts with `die`).
fn sender_process(path: &std::path::Path, count: u32, seed: u64, die: bool) -> Child {
    let mut command = Command::new(bin_path("tq-peer").unwrap());
    command.args(["send", "--count", &count.to_string(), "--seed", &seed.to_string(), "--to"]).arg(path);
    if die {
        command.arg("--die");
    }
    command.spawn().unwrap()
}

#[test]
fn for_over_a_receiver_ends_once_every_expected_sender_has_gone() {
    let path = socket_path("iter");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    receiver.expect_senders(3);
    // One of them aborts right after its last send: its messages still count, and it has gone.
    let children: Vec<Child> = (0..3).map(|k| sender_process(&path, 7, k * 100, k == 2)).collect();
    let mut received = 0;
    for probe in &mut receiver {
        let probe = probe.unwrap();
        assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0], "{}", probe.note);
        received += 1;
    }
    assert_eq!(received, 21, "the loop ended before every sender's messages were in");
    for (k, mut child) in children.into_iter().enumerate() {
        let status = child.wait().unwrap();
        assert_eq!(status.success(), k != 2, "sender {k}: {status}");
    }
    // Ended for good: the iterator and recv agree.
    assert!(receiver.iter().next().is_none());
    assert!(matches!(receiver.recv(), Err(Error::Disconnected)));
}

#[test]
fn an_owning_iterator_collects_everything_one_sender_sent() {
    let path = socket_path("into-iter");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    receiver.expect_senders(1);
    let mut child = sender_process(&path, 5, 1, false);
    let probes: Vec<Probe> = receiver.into_iter().collect::<Result<_, _>>().unwrap();
    assert_eq!(probes.len(), 5);
    assert!(child.wait().unwrap().success());
}

#[test]
fn try_iter_takes_what_is_there_and_never_waits() {
    let path = socket_path("try-iter");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    assert_eq!(receiver.try_iter().count(), 0, "nobody has connected: nothing, at once");
    receiver.expect_senders(1);
    let mut child = sender_process(&path, 4, 2, false);
    // The first message by waiting; the rest as they are there, without a wait.
    let mut received = vec![receiver.recv().unwrap()];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while received.len() < 4 {
        assert!(std::time::Instant::now() < deadline, "only {} of 4 after a minute", received.len());
        received.extend(receiver.try_iter().map(Result::unwrap));
        std::thread::yield_now();
    }
    assert!(child.wait().unwrap().success());
    assert_eq!(receiver.try_iter().count(), 0, "every sender has gone: it ends");
    assert!(matches!(receiver.try_recv(), Err(Error::Disconnected)));
}
