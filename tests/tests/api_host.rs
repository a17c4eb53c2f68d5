//! The tensor API on host tensors, as a user outside the workspace calls it (runs in CI): the
//! same calls as on the GPU, and a pipeline stage that forwards what it received.

use std::process::Command;
use std::time::{Duration, Instant};

use integration_tests::queue::{Probe, checksum};
use integration_tests::{bin_path, socket_path};
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

#[test]
fn host_tensors_read_back_in_row_major_order_whatever_their_layout() {
    let t = Tensor::from_slice(&(0..6).collect::<Vec<i64>>(), DType::I64, &[2, 3]).unwrap();
    assert_eq!(t.to_vec::<i64>().unwrap(), [0, 1, 2, 3, 4, 5]);
    assert_eq!(t.transpose(0, 1).unwrap().to_vec::<i64>().unwrap(), [0, 3, 1, 4, 2, 5]);
    assert!(t.to_vec::<f64>().is_err(), "the element type must match");
    let strided = t.transpose(0, 1).unwrap();
    let packed = strided.contiguous().unwrap();
    assert!(packed.is_contiguous() && packed.to_vec::<i64>().unwrap() == [0, 3, 1, 4, 2, 5]);
    let target = Tensor::zeros(DType::I64, &[2, 3]).unwrap();
    target.transpose(0, 1).unwrap().fill(7i64).unwrap();
    assert_eq!(target.to_vec::<i64>().unwrap(), [7; 6], "a strided fill");
    strided.copy_into(&target.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(target.to_vec::<i64>().unwrap(), [0, 1, 2, 3, 4, 5], "copied through two strided views");
    assert!(t.copy_into(&Tensor::zeros(DType::I64, &[6]).unwrap()).is_err(), "shapes must match");
}

#[test]
fn a_stage_copies_what_it_received_and_sends_it_on() {
    let (first, second) = (socket_path("api-first"), socket_path("api-second"));
    let mut stage = Receiver::<Tensor>::bind(&first).unwrap();
    let mut last = Receiver::<Tensor>::bind(&second).unwrap();
    let to_stage = Sender::<Tensor>::connect(&first).unwrap();
    let onward = Sender::<Tensor>::connect(&second).unwrap();
    let original = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], DType::F32, &[2, 3]).unwrap();
    to_stage.send(&original.transpose(0, 1).unwrap()).unwrap();
    let received = stage.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(matches!(onward.send(&received), Err(Error::NotSendable(_))), "a received tensor is the sender's");
    let copy = received.copy().unwrap();
    assert!(copy.is_contiguous());
    onward.send(&copy).unwrap();
    drop(received);
    assert!(to_stage.wait_released(Duration::from_secs(10)), "the original comes back once the stage drops it");
    let arrived = last.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(arrived.to_vec::<f32>().unwrap(), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
}

/// Found by an outside test: with independent senders, a bound receiver's `recv` said
/// `Disconnected` in the moment between one sender leaving and the next arriving. With
/// `expect_senders` the end is definite.
#[test]
fn independent_senders_end_a_stream_when_the_last_expected_one_leaves() {
    let path = socket_path("expected");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    receiver.expect_senders(3);
    let mut received = 0;
    for k in 0..3u64 {
        // One after another, each gone before the next comes.
        let status = Command::new(bin_path("tq-peer").unwrap())
            .args(["send", "--count", "10", "--seed", &(k * 100).to_string(), "--to"])
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success());
        while received < 10 * (k + 1) {
            let probe = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
            assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0]);
            received += 1;
        }
    }
    assert!(matches!(receiver.recv_timeout(Duration::from_secs(30)), Err(Error::Disconnected)));
    assert!(!path.exists(), "no more may join: the socket file is gone");
}

#[test]
fn a_receiver_that_stops_accepting_ends_when_its_senders_leave() {
    let path = socket_path("stop");
    let mut receiver = Receiver::<u32>::bind(&path).unwrap();
    let sender = Sender::<u32>::connect(&path).unwrap();
    sender.send(&1).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap(), 1);
    receiver.stop_accepting().unwrap();
    assert!(Sender::<u32>::connect(&path).is_err(), "nobody new can connect");
    sender.send(&2).unwrap();
    drop(sender);
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap(), 2);
    assert!(matches!(receiver.recv_timeout(Duration::from_secs(10)), Err(Error::Disconnected)));
}

/// Found by an outside test: a child that hung before `from_parent` hung its parent.
#[test]
fn spawn_timeout_gives_up_on_a_child_that_never_takes_its_channel() {
    let start = Instant::now();
    let hung = tensor_queue::spawn_timeout::<u32>(Command::new("sleep").arg("30"), Duration::from_millis(300));
    assert!(matches!(hung, Err(Error::Timeout)), "{:?}", hung.err());
    assert!(start.elapsed() < Duration::from_secs(10), "the timeout was kept");
    let gone = tensor_queue::spawn_timeout::<u32>(&mut Command::new("true"), Duration::from_secs(10));
    let gone = gone.map(drop).unwrap_err();
    assert!(
        matches!(gone, Error::ChildNotReady { step: tensor_queue::SpawnStep::Exited { status }, .. } if status.success()),
        "{gone:?}"
    );
    assert!(gone.to_string().contains("before taking"), "{gone}");
    // A child that takes its channel is ready well within the time.
    let mut command = Command::new(bin_path("tq-peer").unwrap());
    command.arg("soak");
    let (child, sender) =
        tensor_queue::spawn_timeout::<integration_tests::queue::SoakItem>(&mut command, Duration::from_secs(10))
            .unwrap();
    drop(sender);
    assert!(child.wait_with_output().unwrap().status.success());
}

/// Found by an outside test: `from_parent` went one way only; answers needed a second channel.
#[test]
fn a_duplex_child_answers_on_the_same_spawn() {
    let mut command = Command::new(bin_path("tq-peer").unwrap());
    command.arg("double");
    let (mut child, numbers, mut answers) = tensor_queue::spawn_duplex::<u64, u64>(&mut command).unwrap();
    for n in 0..100u64 {
        numbers.send(&n).unwrap();
        assert_eq!(answers.recv_timeout(Duration::from_secs(10)).unwrap(), n * 2);
    }
    drop(numbers);
    assert!(child.wait().unwrap().success());
}
