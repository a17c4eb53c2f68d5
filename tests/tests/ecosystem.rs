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

/// Whether `fd` is readable now.
fn readable(fd: &impl std::os::fd::AsFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap() > 0
}

/// Waits up to a minute for `fd` to be readable.
fn wait_readable(fd: &impl std::os::fd::AsFd) {
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    let n = rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 60, tv_nsec: 0 })).unwrap();
    assert_eq!(n, 1, "not readable after a minute");
}

#[test]
fn a_receiver_s_descriptor_is_readable_exactly_while_recv_can_make_progress() {
    let path = socket_path("as-fd");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    assert!(!readable(&receiver), "nothing has happened yet");
    receiver.expect_senders(1);
    let mut child = sender_process(&path, 3, 5, false);
    let mut received = 0;
    loop {
        wait_readable(&receiver);
        match receiver.try_recv() {
            Ok(_) => received += 1,
            Err(Error::Empty) => {} // a greeting or a hang-up being read, not a message
            Err(Error::Disconnected) => break,
            Err(other) => panic!("{other}"),
        }
    }
    assert_eq!(received, 3);
    assert!(child.wait().unwrap().success());
    // The end stays visible: whoever waits on it learns it at once.
    assert!(readable(&receiver));
    assert!(matches!(receiver.try_recv(), Err(Error::Disconnected)));
}

#[test]
fn an_idle_connected_receiver_is_not_readable_and_a_held_message_keeps_it_readable() {
    use tensor_queue::Sender;
    let path = socket_path("as-fd-idle");
    let mut receiver = Receiver::<u32>::bind(&path).unwrap();
    let sender = Sender::<u32>::connect(&path).unwrap();
    for i in 0..3 {
        sender.send(&i).unwrap();
    }
    assert_eq!(receiver.recv().unwrap(), 0);
    // Two more were read with the first, or are on the socket: readable either way.
    assert!(readable(&receiver), "messages wait, but the descriptor says nothing");
    assert_eq!(receiver.recv().unwrap(), 1);
    assert_eq!(receiver.recv().unwrap(), 2);
    // Drain what is not a message (the greeting, if not read yet), then nothing is left.
    assert!(matches!(receiver.try_recv(), Err(Error::Empty)), "a fourth message?");
    assert!(!readable(&receiver), "an idle receiver must not wake its waiter (a busy loop in async code)");
    drop(sender);
    wait_readable(&receiver);
}

#[test]
fn select_waits_on_receivers_fed_by_several_processes_until_all_have_ended() {
    use tensor_queue::channel::Select;
    let paths = [socket_path("select-a"), socket_path("select-b")];
    let mut receivers: Vec<Receiver<Probe>> = paths.iter().map(|p| Receiver::bind(p).unwrap()).collect();
    let mut select = Select::new();
    for receiver in &mut receivers {
        receiver.expect_senders(2);
        select.add(receiver).unwrap();
    }
    let children: Vec<Child> =
        (0..4).map(|k| sender_process(&paths[k % 2], 6 + k as u32, k as u64 * 10, k == 3)).collect();
    let mut counts = [0usize; 2];
    let mut open = 2;
    while open > 0 {
        let i = select.ready_timeout(std::time::Duration::from_secs(60)).expect("nothing ready for a minute");
        // Until the receiver is empty or ended: a message that comes after `try_iter` stopped is
        // counted too (this loop once dropped it, uncounted, and saw 13 of 14 in CI).
        loop {
            match receivers[i].try_recv() {
                Ok(probe) => {
                    assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0]);
                    counts[i] += 1;
                }
                Err(Error::Empty) => break,
                Err(Error::Disconnected) => {
                    select.remove(i);
                    open -= 1;
                    break;
                }
                Err(other) => panic!("receiver {i}: {other}"),
            }
        }
    }
    // a: senders 0 and 2 (6 + 8); b: senders 1 and 3 (7 + 9, the last one aborting after its sends).
    assert_eq!(counts, [14, 16]);
    for (k, mut child) in children.into_iter().enumerate() {
        assert_eq!(child.wait().unwrap().success(), k != 3);
    }
    assert!(matches!(select.try_ready(), Err(Error::NothingToSelect)), "nothing left to wait for");
}

#[test]
fn tensors_made_by_the_conversions_arrive_as_they_were_made() {
    use integration_tests::queue::{Report, spawn_tq_peer};
    use tensor_queue::{DType, Tensor};
    let (mut child, sender, mut reports) = spawn_tq_peer::<Probe, Report>("checksum", &[], &[]).unwrap();
    let array = ndarray::Array2::from_shape_fn((3, 5), |(i, j)| (i * 5 + j) as f32);
    let tensors = vec![
        Tensor::try_from(vec![1i64, -2, 3]).unwrap(),
        Tensor::new(&[0.5f64; 6], &[2, 3]).unwrap(),
        Tensor::build::<i32>(&[4, 4], |data| data.iter_mut().enumerate().for_each(|(i, x)| *x = i as i32 * 3)).unwrap(),
        Tensor::try_from(&array.t()).unwrap(), // a transposed view, copied in its logical order
        Tensor::try_from(vec![half::bf16::from_f32(0.25), half::bf16::from_f32(8.0)]).unwrap(),
    ];
    assert_eq!(tensors[4].dtype(), DType::BF16);
    let expected: Vec<u64> = tensors.iter().map(|t| checksum(t).unwrap()).collect();
    sender.send(&Probe { id: 1, tensors, expected: expected.clone(), note: "conversions".into() }).unwrap();
    let report = reports.recv().unwrap();
    assert_eq!(report.checksums, expected, "the other process saw other bytes");
    drop(sender);
    assert!(child.wait().unwrap().success());
    // And back out into an array: the transposed array's values, in its order.
    let t = Tensor::try_from(&array.t()).unwrap();
    let back = ndarray::ArrayD::<f32>::try_from(&t).unwrap();
    assert_eq!(back, array.t().into_dyn());
}

#[test]
fn endpoints_that_are_neither_a_path_nor_tcp_host_port_are_refused_with_the_reason() {
    use tensor_queue::EndpointProblem;
    use tensor_queue::Sender;
    let bad = |result: tensor_queue::Result<()>, expected: EndpointProblem| match result {
        Err(error @ Error::BadEndpoint { .. }) => {
            let Error::BadEndpoint { problem, .. } = &error else { unreachable!() };
            assert_eq!(problem, &expected);
            error.to_string()
        }
        other => panic!("expected Error::BadEndpoint, got {other:?}"),
    };
    let why = bad(Receiver::<u32>::bind("http://127.0.0.1:0").map(drop), EndpointProblem::Scheme("http".into()));
    assert!(why.contains("`http://`") && why.contains("tcp://host:port"), "{why}");
    let why = bad(Sender::<u32>::connect("unix:///tmp/x.sock").map(drop), EndpointProblem::Scheme("unix".into()));
    assert!(why.contains("`unix://`") && why.starts_with("unix:///tmp/x.sock"), "{why}");
    let why = bad(Receiver::<u32>::bind("tcp://127.0.0.1").map(drop), EndpointProblem::NoPort);
    assert!(why.contains("needs a port"), "{why}");
    let why = bad(Sender::<u32>::connect("tcp://[::1]").map(drop), EndpointProblem::NoPort);
    assert!(why.contains("needs a port"), "{why}");
    let why = bad(Receiver::<u32>::bind("tcp://127.0.0.1:http").map(drop), EndpointProblem::BadPort("http".into()));
    assert!(why.contains("`http` is not a number"), "{why}");
}

#[test]
fn connecting_where_no_receiver_is_bound_names_the_path_and_the_likely_cause() {
    use tensor_queue::Sender;
    let path = socket_path("nobody");
    match Sender::<u32>::connect(&path) {
        Err(error @ Error::NoReceiver { .. }) => {
            let text = error.to_string();
            assert!(text.contains(&path.display().to_string()), "{text}");
            assert!(text.contains("is the receiver bound"), "{text}");
        }
        other => panic!("expected Error::NoReceiver, got {:?}", other.map(drop)),
    }
    // A socket file left by a receiver that is gone: refused, and said the same way.
    let receiver = Receiver::<u32>::bind(&path).unwrap();
    let stale = path.with_extension("stale");
    std::fs::hard_link(&path, &stale).unwrap();
    drop(receiver);
    assert!(matches!(Sender::<u32>::connect(&stale), Err(Error::NoReceiver { .. })));
    std::fs::remove_file(&stale).unwrap();
}

#[test]
fn spawning_a_missing_program_names_it() {
    let missing = std::env::temp_dir().join("tq-no-such-worker");
    match tensor_queue::spawn::<u32>(&mut Command::new(&missing)) {
        Err(error @ Error::ChildNotStarted { .. }) => {
            assert!(error.to_string().contains("tq-no-such-worker"), "{error}")
        }
        other => panic!("expected Error::ChildNotStarted, got {:?}", other.map(drop)),
    }
    let gone = tensor_queue::spawn_timeout::<u32>(&mut Command::new("true"), std::time::Duration::from_secs(10));
    let gone = gone.map(drop).unwrap_err();
    let text = gone.to_string();
    assert!(
        matches!(gone, Error::ChildNotReady { .. }) && text.contains("true") && text.contains("from_parent"),
        "{gone:?}"
    );
}

#[test]
fn spawn_ready_says_which_step_failed_and_spawn_timeout_keeps_its_errors() {
    use std::time::Duration;
    use tensor_queue::SpawnStep;
    // A child that exits without taking its channel.
    match tensor_queue::spawn_ready::<u32>(Command::new("sh").args(["-c", "exit 3"]), Duration::from_secs(10)) {
        Err(Error::ChildNotReady { program, step: SpawnStep::Exited { status } }) => {
            assert_eq!(program, "sh");
            assert_eq!(status.code(), Some(3));
        }
        other => panic!("expected ChildNotReady(Exited), got {:?}", other.map(drop)),
    }
    // A child that never takes it: the step and the time it was given, and it is killed.
    let started = std::time::Instant::now();
    match tensor_queue::spawn_ready::<u32>(Command::new("sleep").arg("60"), Duration::from_millis(300)) {
        Err(error @ Error::ChildNotReady { step: SpawnStep::TakeChannel { .. }, .. }) => {
            let Error::ChildNotReady { step: SpawnStep::TakeChannel { timeout }, .. } = &error else { unreachable!() };
            assert_eq!(*timeout, Duration::from_millis(300));
            assert!(error.to_string().contains("from_parent"), "{error}");
        }
        other => panic!("expected ChildNotReady(TakeChannel), got {:?}", other.map(drop)),
    }
    assert!(started.elapsed() < Duration::from_secs(60), "the child was killed, not waited for");
    // spawn_timeout still answers a child that never takes its channel with Error::Timeout.
    let late = tensor_queue::spawn_timeout::<u32>(Command::new("sleep").arg("60"), Duration::from_millis(300));
    assert!(matches!(late, Err(Error::Timeout)), "{:?}", late.err());
}
