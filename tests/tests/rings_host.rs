//! The per-message path through shared-memory rings (issue 26), as an outsider sees it: real
//! processes (`tq-rings`), host tensors, no GPU. Nothing here can tell which path a frame took
//! except what must hold either way: order, nothing lost, a typed end.

use std::os::unix::process::ExitStatusExt as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{bin_path, socket_path, stdout_lines};
use kernels::reference;
use tensor_queue::{DType, Error, Receiver, Sender, Tensor, Violation};

type Item = (u64, Vec<Tensor>);

fn helper(
    role: &str,
    to: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut command = Command::new(bin_path("tq-rings").unwrap());
    command.arg(role).arg("--to").arg(to).args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().unwrap();
    let lines = stdout_lines(&mut child, Some(format!("tq-rings {role}")));
    (child, lines)
}

fn expect_line(lines: &std::sync::mpsc::Receiver<String>, want: &str) {
    let line = lines.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("no `{want}` from the helper"));
    assert_eq!(line, want);
}

/// Checks message `index`'s tensor (if it has one) against the pattern the helper filled it with.
fn check(item: &Item, every: u64, len: usize) {
    let (index, tensors) = item;
    let expected = every != 0 && index.is_multiple_of(every);
    assert_eq!(tensors.len(), usize::from(expected), "message {index}");
    if let Some(tensor) = tensors.first() {
        assert_eq!(tensor.to_bytes().unwrap(), reference::pattern(len, *index), "message {index}'s bytes");
    }
}

fn bind(tag: &str, capacity: u32) -> (Receiver<Item>, std::path::PathBuf) {
    let path = socket_path(tag);
    (Receiver::builder().capacity(capacity).bind(&path).unwrap(), path)
}

/// The end of the stream, and not a wait for ever: a typed `Disconnected`.
fn expect_end(receiver: &mut Receiver<Item>) {
    match receiver.recv_timeout(Duration::from_secs(30)) {
        Err(Error::Disconnected) => {}
        other => panic!("expected the end of the stream, got {:?}", other.map(|(index, _)| index)),
    }
}

#[test]
fn a_producer_killed_after_pushing_has_every_message_delivered_then_the_end() {
    let (mut receiver, path) = bind("rings-burst", 512);
    let (mut child, lines) = helper("burst", &path, &["--count", "400", "--every", "7", "--len", "4096"], &[]);
    let first = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(first.0, 0);
    check(&first, 1, 4096);
    drop(first); // released: the producer sends the rest
    expect_line(&lines, "sent");
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "the producer kills itself: {status:?}");
    // Only now does the receiver read: what the dead producer pushed is all there, in order.
    for index in 1..400 {
        let item = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(item.0, index);
        check(&item, 7, 4096);
    }
    expect_end(&mut receiver);
}

/// The outside tester's bug (round 5, B1): a producer SIGKILLed with messages its `send` had
/// accepted still in its own queue (its ring full, the receiver not reading) lost them, and the
/// receiver took the end for a clean goodbye. Now the sender publishes what it accepted in its
/// ring's shared memory: every message it wrote is delivered, in order, and the rest are
/// reported, counted (`Error::Unsent`), as the cause of the connection's closing.
#[test]
fn a_producer_killed_with_messages_still_queued_has_them_reported_as_lost() {
    const COUNT: u64 = 20_000;
    let (mut receiver, path) = bind("rings-overflow", COUNT as u32);
    let (mut child, lines) = helper("overflow", &path, &["--count", &COUNT.to_string(), "--len", "64"], &[]);
    let first = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(first.0, 0);
    drop(first); // released: the producer sends the rest
    expect_line(&lines, "queued");
    assert_eq!(child.wait().unwrap().signal(), Some(9), "the producer kills itself");
    let mut delivered = 0;
    loop {
        match receiver.recv_timeout(Duration::from_secs(30)) {
            Ok((index, tensors)) => {
                delivered += 1;
                assert_eq!((index, tensors.len()), (delivered, 0), "in order, whole");
            }
            Err(Error::Disconnected) => break,
            Err(other) => panic!("after {delivered} messages: {other}"),
        }
    }
    assert!(delivered < COUNT - 1, "the producer died with none queued: the test proves nothing");
    let errors = receiver.take_errors();
    let unsent = errors.iter().find_map(|error| match error {
        Error::ConnectionClosed { cause, .. } => match cause.as_ref() {
            Error::Unsent { count, .. } => Some(*count),
            _ => None,
        },
        _ => None,
    });
    assert_eq!(unsent, Some(COUNT - 1 - delivered), "{delivered} delivered; errors {errors:?}");
}

/// The outside tester's bug (round 5, B4): a sender that connected (its `Hello` sent) and died
/// before the receiver's greeting was dropped by the accept thread when the greeting failed, so
/// a receiver waiting for its senders (`expect_senders`) never ended. Its `Hello` is read now: it
/// counts as a sender that joined and left.
#[test]
fn a_sender_gone_before_its_greeting_counts_as_joined_and_left() {
    let path = socket_path("late-greeting");
    let (mut receiver, lines) = helper("receive", &path, &[], &[("TENSOR_QUEUE_TEST_LATE_GREETING", "1")]);
    expect_line(&lines, "bound");
    // A sender's opening, by hand, then gone before the receiver greets (300 ms later).
    let connection = ipc_core::seqpacket::Connection::connect(&path).unwrap();
    let hello = tensor_queue::testing::wire::Hello {
        pid: std::process::id(),
        host: ipc_core::HostId::current().unwrap().0,
        capacity: 0,
        instance: 7,
        reach: Default::default(),
        routing: Default::default(),
    };
    connection.send(&tensor_queue::testing::wire::Frame::encode(&hello), &[]).unwrap();
    drop(connection);
    expect_line(&lines, "end");
    assert!(receiver.wait().unwrap().success());
}

/// A receiver offers its rings before its `Hello`, so a sender has switched to them before the
/// `Hello` gives it credits, and a burst right after `connect` goes by the rings from its first
/// message. The offer came after the `Hello`: a burst could fill the socket first, and what the
/// socket could not take waited in the sender (outside round 5: a finished producer's exit then
/// waited up to a minute for a receiver that read only after it;
/// `test_iteration_over_a_killed_and_a_finished_child_ends_after_their_messages`).
#[test]
fn the_offer_of_rings_comes_before_the_receivers_hello() {
    use tensor_queue::testing::wire::{Frame as _, Hello, LinkFrame};
    let path = socket_path("offer-first");
    let _receiver = Receiver::<u64>::bind(&path).unwrap();
    let connection = ipc_core::seqpacket::Connection::connect(&path).unwrap();
    connection.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
    connection.send(&integration_tests::raw::hello(0, 9).encode(), &[]).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let (n, fds) = connection.recv(&mut buf).unwrap();
    assert_eq!(LinkFrame::decode(&buf[..n]), Ok(LinkFrame::Rings), "the receiver's first frame is its offer");
    assert_eq!(fds.len(), 4, "both rings and both doorbells");
    let (n, _) = connection.recv(&mut buf).unwrap();
    assert!(Hello::decode(&buf[..n]).is_ok(), "then its Hello");
}

/// A sender that sent its messages (on the socket: no rings yet) and exited before the
/// receiver's offer of rings keeps every message: the offer finding it gone does not drop the
/// connection (it did: the messages were lost and the receiver waited for ever for its sender).
#[test]
fn a_sender_gone_before_the_offer_of_rings_has_every_message_delivered() {
    let path = socket_path("late-offer");
    let (mut receiver, lines) = helper("receive", &path, &[], &[("TENSOR_QUEUE_TEST_LATE_RING_OFFER", "1")]);
    expect_line(&lines, "bound");
    let (mut sender, sent) = helper("quick", &path, &["--count", "4"], &[]);
    expect_line(&sent, "sent");
    assert!(sender.wait().unwrap().success(), "the sender exited cleanly");
    for index in 0..4 {
        expect_line(&lines, &format!("got {index}"));
    }
    expect_line(&lines, "end");
    assert!(receiver.wait().unwrap().success());
}

/// A sender whose `send` returned is connected: a receiver whose earlier senders had all gone
/// takes its message, not the end of the stream, while the accept thread still greets it (here
/// the offer of rings comes 300 ms after the `Hello` that let the sender send). `recv` said
/// `Disconnected` in that window: the thread handed the connection over only after greeting it.
#[test]
fn a_sender_greeted_but_not_yet_handed_over_is_not_the_end_of_the_stream() {
    use std::io::Write as _;
    let path = socket_path("rejoin");
    let (mut receiver, lines) = helper("rejoin", &path, &[], &[("TENSOR_QUEUE_TEST_LATE_RING_OFFER", "1")]);
    expect_line(&lines, "bound");
    let first = Sender::<Item>::connect(&path).unwrap();
    first.send(&(0, Vec::new())).unwrap();
    drop(first);
    expect_line(&lines, "got 0");
    expect_line(&lines, "ended");
    let second = Sender::<Item>::connect(&path).unwrap();
    second.send(&(1, Vec::new())).unwrap(); // greeted: the offer of rings is 300 ms away
    writeln!(receiver.stdin.as_mut().unwrap(), "recv").unwrap();
    expect_line(&lines, "got 1");
    drop(second);
    assert!(receiver.wait().unwrap().success());
}

#[test]
fn a_producer_killed_between_a_marker_and_its_frame_ends_the_stream() {
    // Capacity 1: the second send waits for a credit, which comes after the rings are on, so
    // its announcement is a marker on the ring and a frame on the socket; it dies in between.
    let (mut receiver, path) = bind("rings-marker", 1);
    let (mut child, _lines) = helper("marker", &path, &[], &[("TENSOR_QUEUE_TEST_DIE_AFTER_MARKER", "1")]);
    let first = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(first.0, 0);
    expect_end(&mut receiver);
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "the producer died at its marker (rings on): {status:?}");
}

#[test]
fn a_peer_scribbling_on_its_ring_gets_a_typed_error_and_the_others_go_on() {
    let (mut receiver, path) = bind("rings-scribble", 64);
    let (mut scribbler, scribbled) = helper("scribble", &path, &[], &[]);
    // The receiver reads the scribbler's switch and ring while it waits for the others' messages.
    let (mut senders, done) =
        helper("senders", &path, &["--threads", "2", "--count", "100", "--every", "5", "--len", "1000"], &[]);
    expect_line(&scribbled, "scribbled");
    let mut next = [0u64; 2];
    let mut count = 0;
    while count < 200 {
        let item = match receiver.recv_timeout(Duration::from_secs(30)) {
            Ok(item) => item,
            // A bound receiver between the scribbler's end and the others' start: nobody there.
            Err(Error::Disconnected) => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(other) => panic!("{other}"),
        };
        let (thread, i) = ((item.0 / 1_000_000) as usize, item.0 % 1_000_000);
        assert_eq!(i, next[thread], "sender {thread}'s order");
        next[thread] += 1;
        check(&item, 5, 1000);
        count += 1;
    }
    expect_line(&done, "done");
    assert!(senders.wait().unwrap().success());
    let until = Instant::now() + Duration::from_secs(30);
    let error = loop {
        let errors = receiver.take_errors();
        // Typed, to match on: which connection, and why.
        if let Some(Error::ConnectionClosed { cause, .. }) = errors
            .into_iter()
            .find(|e| matches!(e, Error::ConnectionClosed { cause, .. } if matches!(**cause, Error::Violation(Violation::CorruptRing { .. }))))
        {
            break *cause;
        }
        assert!(Instant::now() < until, "no typed error for the scribbler's connection");
        let _ = receiver.recv_timeout(Duration::from_millis(20));
    };
    assert!(error.to_string().contains("ring"), "{error}");
    drop(scribbler.stdin.take());
    let _ = scribbler.wait();
}

#[test]
fn several_senders_in_one_process_keep_their_order_with_announcements_between_messages() {
    for (env, tag) in [(&[][..], "on"), (&[("TQ_RINGS", "0")][..], "refused by the senders")] {
        let (mut receiver, path) = bind("rings-senders", 32);
        let (mut child, done) =
            helper("senders", &path, &["--threads", "4", "--count", "300", "--every", "3", "--len", "70000"], env);
        let mut next = [0u64; 4];
        for _ in 0..1200 {
            let item = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
            let (thread, i) = ((item.0 / 1_000_000) as usize, item.0 % 1_000_000);
            assert_eq!(i, next[thread], "sender {thread}'s order ({tag})");
            next[thread] += 1;
            check(&item, 3, 70000);
        }
        expect_line(&done, "done");
        assert!(child.wait().unwrap().success(), "{tag}");
        expect_end(&mut receiver);
    }
}

#[test]
fn a_receiver_holding_many_messages_releases_them_all_at_the_end() {
    let (mut receiver, path) = bind("rings-hold", 64);
    let (mut child, done) =
        helper("senders", &path, &["--threads", "2", "--count", "1500", "--every", "1", "--len", "64"], &[]);
    let held: Vec<Item> = (0..3000).map(|_| receiver.recv_timeout(Duration::from_secs(30)).unwrap()).collect();
    assert!(held.iter().all(|(_, tensors)| tensors.len() == 1));
    // The senders wait until everything is released: it is, once we let go.
    drop(held);
    expect_line(&done, "done");
    assert!(child.wait().unwrap().success());
    expect_end(&mut receiver);
}

/// This process's descriptor slots, as the kernel says (`FDSize` in `/proc/self/status`).
fn descriptor_slots() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().find_map(|line| line.strip_prefix("FDSize:")).unwrap().trim().parse().unwrap()
}

/// The bug this fixed: a channel's first connection (its rings, doorbells, a chunk) grew a
/// CUDA process's descriptor table past 64 and 128 slots in the middle of the first message,
/// and Linux grows the table of a process with threads under `synchronize_rcu()`: 6-21 ms on
/// the GPU machine, in one `memfd_create` and one `recvmsg` (`tq-bench` set-up). A receiver and
/// a sender now grow it before their threads, so no message pays for it.
#[test]
fn a_channel_makes_room_for_its_descriptors_before_its_first_message() {
    let (mut receiver, path) = bind("fd-room", 4);
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(u64::MAX);
    let want = u64::from(ipc_core::fd_passing::RESERVED_TABLE).min(limit);
    assert!(descriptor_slots() >= want, "{} slots after bind, want {want}", descriptor_slots());
    let sender = tensor_queue::Sender::<Item>::connect(&path).unwrap();
    let tensor = Tensor::from_slice(&[1u8, 2, 3], tensor_queue::DType::U8, &[3]).unwrap();
    sender.send(&(0, vec![tensor])).unwrap();
    let (index, tensors) = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!((index, tensors[0].to_bytes().unwrap()), (0, vec![1, 2, 3]));
    assert!(descriptor_slots() >= want);
}

/// A message as the helper makes them: `index`, with a host tensor of `len` bytes filled with its
/// pattern if `every` divides it.
fn item(index: u64, every: u64, len: usize) -> Item {
    let tensors = match every != 0 && index.is_multiple_of(every) {
        true => vec![Tensor::from_slice(&reference::pattern(len, index), DType::U8, &[len as u64]).unwrap()],
        false => Vec::new(),
    };
    (index, tensors)
}

/// The same random short pauses as the helper's (`tq-rings`'s `pause`).
fn pause(state: &mut u64) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    let micros = (*state >> 8) % 50;
    match *state % 4 {
        0 => {}
        1 => {
            let until = Instant::now() + Duration::from_micros(micros % 20);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        2 => std::thread::yield_now(),
        _ => std::thread::sleep(Duration::from_micros(micros)),
    }
}

/// 20,000 blocking round trips between two processes, each side pausing at random (none, a
/// spin, a yield, a sleep) so that every message finds its receiver now busy, now about to sleep,
/// now asleep; every 97th message carries a tensor (its announcement on the socket behind a
/// marker in the ring). A wake-up lost on either side would leave a `recv` waiting: the 30 s
/// timeouts turn it into a failure, never a hang.
#[test]
fn twenty_thousand_blocking_round_trips_with_random_pauses_lose_no_wake_up() {
    const TRIPS: u64 = 20_000;
    let (mut receiver, path) = bind("pingpong", 16);
    let reply = socket_path("pingpong-reply");
    let reply_arg = reply.to_str().unwrap();
    let count = TRIPS.to_string();
    let args = ["--reply", reply_arg, "--count", &count, "--every", "97", "--len", "256", "--seed", "7"];
    let (mut child, lines) = helper("pingpong", &path, &args, &[]);
    expect_line(&lines, "bound");
    let sender = Sender::<Item>::connect(&reply).unwrap();
    let mut random = 0x9e37_79b9_7f4a_7c15_u64;
    for index in 0..TRIPS {
        sender.send(&item(index, 97, 256)).unwrap();
        pause(&mut random);
        let got = receiver
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|error| panic!("round trip {index}: {error} (a lost wake-up on one side or the other)"));
        assert_eq!(got.0, index, "answers in order");
        check(&got, 97, 256);
    }
    assert!(sender.wait_released(Duration::from_secs(30)), "every message released");
    expect_line(&lines, "done");
    expect_end(&mut receiver);
    assert!(child.wait().unwrap().success());
}

/// A `recv` blocked on a connection whose rings are on (its ring just found empty, its doorbell
/// armed) wakes for the sender's hang-up, which only the socket shows: a clean exit and a
/// SIGKILL both end the stream with `Disconnected`, after every message.
#[test]
fn a_blocked_recv_wakes_for_the_hang_up_of_a_sender_on_the_rings() {
    for kill in [false, true] {
        let (mut receiver, path) = bind(if kill { "linger-kill" } else { "linger" }, 16);
        receiver.expect_senders(1);
        let args: &[&str] = if kill { &["--ms", "300", "--kill"] } else { &["--ms", "300"] };
        let (mut child, lines) = helper("linger", &path, args, &[]);
        for index in 0..2 {
            let got = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
            assert_eq!(got.0, index);
            check(&got, 1, 4096);
        }
        expect_line(&lines, "sent");
        // Blocked here while the helper sleeps, then woken by its end.
        expect_end(&mut receiver);
        let status = child.wait().unwrap();
        assert_eq!(status.signal().is_some(), kill, "{status:?}");
        assert!(receiver.take_errors().is_empty(), "nothing was lost");
    }
}

/// A receiver watches each connection's socket and ring doorbell in its own poll set (one level
/// of epoll): once a sender has hung up and `recv` has read it, both leave the set, even while
/// a tensor received from it (which keeps the link open for its release) is held. Left there,
/// the socket's end would keep the receiver's descriptor readable, and every `recv` and
/// `Select` would wake at once, for ever.
#[test]
fn a_sender_that_hung_up_no_longer_makes_the_receiver_readable() {
    let (mut receiver, path) = bind("unwatch", 16);
    receiver.expect_senders(2); // not the end of the stream when the first leaves
    let (mut child, lines) = helper("linger", &path, &["--ms", "0"], &[]);
    let first = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(first.0, 0);
    drop(first); // the helper waits for its release
    let held = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(held.0, 1);
    check(&held, 1, 4096);
    expect_line(&lines, "sent");
    assert!(child.wait().unwrap().success());
    // On a thread, bounded: left in the set, the socket's end would make every `try_recv` loop
    // for ever on a poll that returns at once.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut receiver = receiver;
        // Read the hang-up (a zero-timeout `recv` reads what is readable, then says `Empty`).
        let empties = (0..10).filter(|_| matches!(receiver.try_recv(), Err(Error::Empty))).count();
        let mut fds = [rustix::event::PollFd::new(&receiver, rustix::event::PollFlags::IN)];
        let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: 300_000_000 };
        let ready = rustix::event::poll(&mut fds, Some(&timeout)).unwrap();
        let _ = done.send((empties, ready, fds[0].revents()));
        drop(held);
    });
    let (empties, ready, revents) =
        finished.recv_timeout(Duration::from_secs(60)).expect("try_recv did not return within 60 s");
    assert_eq!(empties, 10, "nothing to receive");
    assert_eq!(ready, 0, "the receiver is readable with nothing to receive: {revents:?}");
}

/// The receiver's descriptor (`AsFd`, what `Select` and the async receiver wait on) is readable
/// whenever `recv` may progress, with the rings' doorbells in its poll set: 5,000 round trips
/// where each answer is awaited with `Select` and taken with `try_recv`. A record left in a ring
/// with the descriptor not readable fails the 30 s wait; a descriptor that stays readable with
/// nothing to take fails the bound on empty wake-ups.
#[test]
fn select_over_a_receiver_on_the_rings_wakes_for_each_answer_and_only_then() {
    use tensor_queue::channel::Select;
    const TRIPS: u64 = 5_000;
    let (mut receiver, path) = bind("select-pingpong", 16);
    let reply = socket_path("select-pingpong-reply");
    let count = TRIPS.to_string();
    let args = ["--reply", reply.to_str().unwrap(), "--count", &count, "--every", "50", "--len", "64", "--seed", "3"];
    let (mut child, lines) = helper("pingpong", &path, &args, &[]);
    expect_line(&lines, "bound");
    let sender = Sender::<Item>::connect(&reply).unwrap();
    let mut select = Select::new();
    select.add(&receiver).unwrap();
    let mut empty_wakes = 0;
    for index in 0..TRIPS {
        sender.send(&item(index, 50, 64)).unwrap();
        let got = loop {
            if let Err(error) = select.ready_timeout(Duration::from_secs(30)) {
                panic!("round trip {index}: not readable within 30 s ({error})");
            }
            match receiver.try_recv() {
                Ok(got) => break got,
                Err(Error::Empty) => empty_wakes += 1,
                Err(error) => panic!("round trip {index}: {error}"),
            }
            assert!(empty_wakes < 1_000 + index, "the receiver stays readable with nothing to take");
        };
        assert_eq!(got.0, index, "answers in order");
        check(&got, 50, 64);
    }
    select.remove(0);
    assert!(sender.wait_released(Duration::from_secs(30)), "every message released");
    expect_line(&lines, "done");
    expect_end(&mut receiver);
    assert!(child.wait().unwrap().success());
}
