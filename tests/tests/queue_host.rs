//! tensor-queue over real processes with host tensors: runs for real in CI.

use std::os::fd::AsFd;
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use integration_tests::queue::{Probe, Report, checksum, probe, spawn_tq_peer};
use integration_tests::raw::raw_client;
use integration_tests::{bin_path, socket_path};
use ipc_core::SharedMemory;
use ipc_core::seqpacket::Connection;
use kernels::reference;
use tensor_queue::testing::wire::{
    ChunkKind, Descriptors, Fence, Frame, LinkFrame, Source, StorageDesc, ToReceiver, ToSender,
};
use tensor_queue::{DType, Error, Receiver, Refusal, Sender, Tensor};

fn peer(role: &str) -> (Child, Sender<Probe>, Receiver<Report>) {
    spawn_tq_peer(role, &[], &[]).unwrap()
}

fn wait_until(what: &str, done: impl FnMut() -> bool) -> Duration {
    integration_tests::queue::wait_until(what, done).unwrap()
}

#[test]
fn host_tensors_of_every_dtype_and_views_arrive_intact() {
    let (mut child, sender, mut reports) = peer("checksum");
    let matrix = Tensor::from_slice(&(0..48).map(|i| i as f32 * 0.5).collect::<Vec<_>>(), DType::F32, &[6, 8]).unwrap();
    let mut tensors = vec![
        matrix.transpose(0, 1).unwrap(),
        matrix.narrow(1, 2, 3).unwrap(),
        Tensor::from_slice(&reference::pattern(1000, 3), DType::U8, &[10, 100]).unwrap(),
    ];
    for dtype in DType::ALL {
        let bytes = reference::pattern(dtype.size() * 30, dtype as u64);
        let tensor = Tensor::from_slice(&bytes, DType::U8, &[bytes.len() as u64]).unwrap();
        tensors.push(retype(tensor, dtype));
    }
    let expected: Vec<u64> = tensors.iter().map(|t| checksum(t).unwrap()).collect();
    sender.send(&Probe { id: 7, tensors, expected: expected.clone(), note: "views".into() }).unwrap();
    let report = reports.recv().unwrap();
    assert_eq!(report.id, 7);
    assert_eq!(report.checksums, expected, "the child saw other bytes");
    assert!(report.paths.iter().all(|p| p == "HostSharedMemory"), "{:?}", report.paths);
    drop(sender);
    assert!(child.wait().unwrap().success());
}

/// The same bytes seen as another dtype (a Bool's as 0 or 1).
fn retype(tensor: Tensor, dtype: DType) -> Tensor {
    let numel = (tensor.nbytes() / dtype.size()) as u64;
    let mut bytes = tensor.to_bytes().unwrap();
    if dtype == DType::Bool {
        bytes.iter_mut().for_each(|b| *b &= 1);
    }
    Tensor::from_bytes(&bytes, dtype, &[numel]).unwrap()
}

#[test]
fn several_senders_feed_one_receiver_until_all_are_gone() {
    let path = socket_path("many");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let children: Vec<Child> = (0..3)
        .map(|k| {
            Command::new(bin_path("tq-peer").unwrap())
                .args(["send", "--count", "20", "--seed", &(k * 1000).to_string(), "--to"])
                .arg(&path)
                .spawn()
                .unwrap()
        })
        .collect();
    let mut per_sender = std::collections::HashMap::new();
    let start = Instant::now();
    let mut children = children;
    while per_sender.values().sum::<usize>() < 60 {
        match receiver.recv_with_info(Some(Duration::from_secs(30))) {
            Ok((probe, info)) => {
                assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0], "{}", probe.note);
                *per_sender.entry(info.sender_pid).or_insert(0) += 1;
            }
            // A bound receiver: between one sender leaving and the next connecting, nobody is there.
            Err(Error::Disconnected) => std::thread::sleep(Duration::from_millis(1)),
            Err(other) => panic!("{other}"),
        }
        if start.elapsed() > Duration::from_secs(40) {
            let states: Vec<_> = children.iter_mut().map(|c| (c.id(), c.try_wait().ok().flatten())).collect();
            panic!("only {per_sender:?} after 40 s; receiver errors {:?}; children {states:?}", receiver.take_errors());
        }
    }
    assert_eq!(per_sender.len(), 3);
    assert!(per_sender.values().all(|&n| n == 20), "{per_sender:?}");
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
    assert!(matches!(receiver.recv_timeout(Duration::from_secs(30)), Err(Error::Disconnected)));
}

#[test]
fn a_full_queue_blocks_the_sender_until_the_receiver_takes_a_message() {
    let path = socket_path("capacity");
    let mut receiver = Receiver::<u64>::bind_with_capacity(&path, 2).unwrap();
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    let sending = std::thread::spawn(move || {
        let sender = Sender::<u64>::connect(&path).unwrap();
        for i in 0..5 {
            sender.send(&i).unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    wait_until("two sends", || sent.load(Ordering::SeqCst) == 2);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(sent.load(Ordering::SeqCst), 2, "a third send went through a full queue");
    assert_eq!(receiver.recv().unwrap(), 0);
    wait_until("the third send", || sent.load(Ordering::SeqCst) == 3);
    for expected in 1..5 {
        assert_eq!(receiver.recv().unwrap(), expected, "messages keep their order");
    }
    sending.join().unwrap();
    assert!(matches!(receiver.try_recv(), Err(Error::Disconnected)));
}

#[test]
fn leases_return_by_themselves_and_memory_is_reused() {
    let (mut child, sender, mut reports) = peer("checksum");
    for id in 0..10 {
        let probe = probe(id, id, 1 << 16, None).unwrap();
        sender.send(&probe).unwrap();
    }
    for _ in 0..10 {
        let report = reports.recv().unwrap();
        assert_eq!(report.checksums[0], reference::checksum(&reference::pattern(1 << 16, report.id)));
    }
    wait_until("every lease back", || sender.outstanding_leases() == 0);
    drop(sender);
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_killed_receiver_returns_every_lease_and_the_sender_serves_others() {
    let (mut doomed, to_doomed, mut doomed_reports) = peer("hold");
    let (mut survivor, to_survivor, mut survivor_reports) = peer("checksum");
    let held: Vec<Tensor> = (0..4)
        .map(|i| {
            let p = probe(i, 100 + i, 8192, None).unwrap();
            to_doomed.send(&p).unwrap();
            p.tensors[0].clone()
        })
        .collect();
    for _ in 0..4 {
        doomed_reports.recv().unwrap();
    }
    assert_eq!(to_doomed.outstanding_leases(), 4, "the holder keeps its tensors");
    doomed.kill().unwrap();
    let took = wait_until("leases of the killed receiver", || to_doomed.outstanding_leases() == 0);
    eprintln!("leases returned {took:?} after the kill");
    doomed.wait().unwrap();
    assert!(matches!(to_doomed.send(&probe(9, 9, 10, None).unwrap()), Err(Error::Disconnected)));
    // The memory is ours again, and our own views of it were never disturbed.
    assert_eq!(checksum(&held[0]).unwrap(), reference::checksum(&reference::pattern(8192, 100)));
    to_survivor.send(&probe(5, 5, 4096, None).unwrap()).unwrap();
    assert_eq!(survivor_reports.recv().unwrap().checksums[0], reference::checksum(&reference::pattern(4096, 5)));
    drop(to_survivor);
    assert!(survivor.wait().unwrap().success());
}

#[test]
fn a_killed_sender_disconnects_and_what_arrived_stays_readable() {
    let path = socket_path("dying");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let mut child = Command::new(bin_path("tq-peer").unwrap())
        .args(["send", "--count", "3", "--seed", "40", "--die", "--to"])
        .arg(&path)
        .spawn()
        .unwrap();
    let probes: Vec<Probe> = (0..3).map(|_| receiver.recv_timeout(Duration::from_secs(30)).unwrap()).collect();
    assert!(matches!(receiver.recv_timeout(Duration::from_secs(30)), Err(Error::Disconnected)));
    assert!(!child.wait().unwrap().success(), "the sender died");
    for probe in &probes {
        assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0], "data survived its sender");
    }
}

/// A descriptor table of one 64-byte storage record at `source` and one `u8` tensor viewing it
/// whole.
fn one_tensor(source: Source, fence: Fence) -> Descriptors {
    let mut tensors = Descriptors::default();
    let storage = tensors.push_storage(StorageDesc { source, len: 64, fence });
    tensors.push_tensor(storage, 0, DType::U8, &[64], &[1]);
    tensors
}

#[test]
fn malformed_and_hostile_frames_close_only_their_connection() {
    let path = socket_path("hostile");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let honest = Sender::<Probe>::connect(&path).unwrap();

    let garbage = raw_client(&path);
    garbage.send(b"TQF1 this is not a frame", &[]).unwrap();

    let unknown_chunk = raw_client(&path);
    let message = |chunk, offset| ToReceiver::Message {
        seq: 1,
        sent_ns: 0,
        encoded_ns: 0,
        tensors: one_tensor(Source::SameDevice { chunk, offset }, Fence::None),
        payload: vec![0, 0, 0],
    };
    unknown_chunk.send(&message(999, 0).encode(), &[]).unwrap();

    let out_of_bounds = raw_client(&path);
    let small = SharedMemory::create("small", 4096).unwrap();
    let announce =
        ToReceiver::Chunk { id: 5, len: 4096, kind: ChunkKind::Host, device: [0; 16], legacy: None, writable: false };
    out_of_bounds.send(&announce.encode(), &[small.fd().as_fd()]).unwrap();
    out_of_bounds.send(&message(5, 4090).encode(), &[]).unwrap();

    honest.send(&probe(1, 77, 1000, None).unwrap()).unwrap();
    // Two well-formed messages that cannot be used here are rejected one by one (the channel
    // goes on); the garbage closes only its own connection.
    let mut rejected = Vec::new();
    let mut honest_probe = None;
    while honest_probe.is_none() || rejected.len() < 2 {
        match receiver.recv_timeout(Duration::from_secs(10)) {
            Ok(probe) => honest_probe = Some(probe),
            Err(Error::Rejected { reason, .. }) => rejected.push(reason),
            Err(other) => panic!("{other}"),
        }
    }
    let probe = honest_probe.unwrap();
    assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0], "the honest sender is unaffected");
    let rejected = rejected.join("\n");
    assert!(rejected.contains("unknown chunk 999"), "{rejected}");
    assert!(rejected.contains("outside chunk 5"), "{rejected}");

    let mut errors = Vec::new();
    wait_until("the closed connection", || {
        errors.extend(receiver.take_errors());
        // Typed, to match on: which connection, and why.
        errors
            .iter()
            .any(|e| matches!(e, Error::ConnectionClosed { cause, .. } if matches!(**cause, Error::Frame { .. })))
    });
    let mut buf = [0u8; 256];
    // The receiver's offer of rings (a link frame) is passed over: these peers stay on the socket.
    let mut said = |client: &Connection| loop {
        let (n, _) = client.recv(&mut buf).unwrap();
        if LinkFrame::decode(&buf[..n]).is_err() {
            break ToSender::decode(&buf[..n]).unwrap();
        }
    };
    assert!(matches!(said(&garbage), ToSender::Close { reason, .. } if reason.contains("bad frame")), "told why");
    assert!(matches!(said(&unknown_chunk), ToSender::Rejected { seq: 1, .. }));
    assert!(matches!(said(&out_of_bounds), ToSender::Rejected { seq: 1, .. }));
    honest.send(&probe_again()).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().id, 2);
}

/// A message's table that lies about its storage records closes only its own connection, with
/// a typed reason: a tensor naming a record the table does not have, two records over the same
/// bytes. A record outside its chunk is refused alone, and the connection goes on.
#[test]
fn a_table_that_lies_about_its_storage_records_is_refused() {
    let path = socket_path("table-lies");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let honest = Sender::<Probe>::connect(&path).unwrap();
    let chunk = SharedMemory::create("table-lies", 4096).unwrap();
    let announce =
        ToReceiver::Chunk { id: 5, len: 4096, kind: ChunkKind::Host, device: [0; 16], legacy: None, writable: false };
    let record = |offset, len| StorageDesc { source: Source::SameDevice { chunk: 5, offset }, len, fence: Fence::None };
    let liar = |tensors: Descriptors| {
        let client = raw_client(&path);
        client.send(&announce.encode(), &[chunk.fd().as_fd()]).unwrap();
        let message = ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors, payload: vec![0] };
        client.send(&message.encode(), &[]).unwrap();
        client
    };
    let mut missing = Descriptors::default();
    let storage = missing.push_storage(record(0, 64));
    missing.push_tensor(storage, 0, DType::U8, &[64], &[1]);
    missing.push_tensor(storage + 1, 0, DType::U8, &[64], &[1]); // no record 1
    let mut overlapping = Descriptors::default();
    let (a, b) = (overlapping.push_storage(record(0, 128)), overlapping.push_storage(record(64, 128)));
    overlapping.push_tensor(a, 0, DType::U8, &[128], &[1]);
    overlapping.push_tensor(b, 0, DType::U8, &[128], &[1]);
    let mut outside = Descriptors::default();
    let storage = outside.push_storage(record(4032, 128)); // 64 bytes past the chunk's end
    outside.push_tensor(storage, 0, DType::U8, &[64], &[1]);
    let clients = [liar(missing), liar(overlapping), liar(outside)];
    let mut rejected = None;
    let mut closed = Vec::new();
    wait_until("two connections closed and one message refused", || {
        match receiver.recv_timeout(Duration::from_millis(100)) {
            Err(Error::Rejected { reason, .. }) => rejected = Some(reason),
            Err(Error::Timeout) => {}
            other => panic!("{:?}", other.map(|p| p.id)),
        }
        for error in receiver.take_errors() {
            if let Error::ConnectionClosed { cause, .. } = error
                && let Error::Frame { source, .. } = *cause
            {
                closed.push(source);
            }
        }
        closed.len() >= 2 && rejected.is_some()
    });
    use tensor_queue::FrameError;
    assert!(
        closed
            .iter()
            .any(|e| matches!(e, FrameError::OutOfBounds { index: 1, reason } if reason.contains("storage record 1"))),
        "{closed:?}"
    );
    assert!(
        closed.iter().any(|e| matches!(e, FrameError::Storage { index: 1, reason } if reason.contains("overlaps"))),
        "{closed:?}"
    );
    let rejected = rejected.unwrap();
    assert!(rejected.contains("storage record 0") && rejected.contains("outside chunk 5"), "{rejected}");
    honest.send(&probe_again()).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().id, 2, "the honest sender is unaffected");
    drop(clients);
}

/// Tensors allocated together, and views of one of them, share one storage record (the
/// receiver builds one storage for them): sent in one message in another order than they lie,
/// each arrives with its own shape and values, and a view of a received tensor reaches no
/// further than its record.
#[test]
fn many_tensors_that_lie_together_arrive_each_as_itself() {
    let path = socket_path("one-record");
    let mut receiver = Receiver::<Vec<Tensor>>::bind(&path).unwrap();
    let sender = Sender::<Vec<Tensor>>::connect(&path).unwrap();
    let mut tensors: Vec<Tensor> =
        (0..300i32).map(|i| Tensor::from_slice(&[i; 100], DType::I32, &[100]).unwrap()).collect();
    let pair = Tensor::from_slice(&(0..12i32).collect::<Vec<_>>(), DType::I32, &[3, 4]).unwrap();
    tensors.push(pair.narrow(1, 1, 2).unwrap());
    tensors.push(pair.transpose(0, 1).unwrap().flip(&[0]).unwrap());
    tensors.push(pair);
    tensors.reverse();
    sender.send(&tensors).unwrap();
    let received = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(received.len(), tensors.len());
    for (sent, got) in tensors.iter().zip(&received) {
        assert_eq!((got.shape(), got.strides()), (sent.shape(), sent.strides()));
        assert_eq!(got.to_vec::<i32>().unwrap(), sent.to_vec::<i32>().unwrap());
    }
    // Their record spans their storages (about 150 KiB), not the sender's whole chunk.
    assert!(received[0].as_layout(DType::U8, &[1 << 20], &[1], 0).is_err(), "a view past the record");
    drop(received);
    assert!(sender.wait_released(Duration::from_secs(10)), "the one lease of the message is given back");
}

fn probe_again() -> Probe {
    probe(2, 78, 10, None).unwrap()
}

#[test]
fn a_soak_of_random_sizes_arrives_byte_exact() {
    let (mut child, sender, mut reports) = peer("checksum");
    let mut state = 0x1234_5678u64;
    let count = 1000;
    let mut expected = Vec::new();
    for id in 0..count {
        state = reference::splitmix64(state);
        let len = 1 + (state % 100_000) as usize;
        let probe = probe(id, state, len, None).unwrap();
        expected.push(probe.expected[0]);
        sender.send(&probe).unwrap();
        while let Ok(report) = reports.try_recv() {
            assert_eq!(report.checksums[0], expected[report.id as usize], "message {}", report.id);
        }
    }
    drop(sender);
    while let Ok(report) = reports.recv_timeout(Duration::from_secs(30)) {
        assert_eq!(report.checksums[0], expected[report.id as usize], "message {}", report.id);
        if report.id == count - 1 {
            break;
        }
    }
    assert!(child.wait().unwrap().success());
}

#[test]
fn another_user_cannot_connect() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    if std::fs::metadata("/proc/self").unwrap().uid() != 0 {
        eprintln!("skipped: running a process as another user needs root");
        return;
    }
    let path = socket_path("private");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let send_as_nobody = || {
        Command::new(bin_path("tq-peer").unwrap())
            .args(["send", "--count", "1", "--to"])
            .arg(&path)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap()
    };
    let output = send_as_nobody();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "another user connected: {stderr}");
    assert!(stderr.contains("Permission denied"), "the socket's mode refused it: {stderr}");
    assert!(matches!(receiver.try_recv(), Err(Error::Empty)), "nothing arrived");
    // Past the file's mode (opened up here on purpose), the user check refuses it, and both sides
    // hear why: the sender a typed refusal, the receiver an entry in its errors.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let output = send_as_nobody();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "another user's message went through: {stderr}");
    assert!(stderr.contains("peer refused") && stderr.contains("runs as uid"), "a typed refusal: {stderr}");
    let mut errors = Vec::new();
    wait_until("the refusal in the receiver's errors", || {
        errors.extend(receiver.take_errors());
        // Typed: who was refused, and why.
        errors.iter().any(|e| matches!(e, Error::PeerRefused(Refusal::OtherUser { uid: 65534, .. })))
    });
    assert!(matches!(receiver.try_recv(), Err(Error::Empty)), "nothing arrived");
}

/// A bound receiver must not report `Disconnected` while a connection its accept thread took is
/// waiting to be read (this once spun a test forever on a 32-core machine).
#[test]
fn a_sender_arriving_after_the_last_one_left_is_heard() {
    let path = socket_path("came-and-went");
    let mut receiver = Receiver::<u64>::bind(&path).unwrap();
    Sender::<u64>::connect(&path).unwrap().send(&1).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap(), 1);
    assert!(matches!(receiver.recv_timeout(Duration::from_secs(10)), Err(Error::Disconnected)), "the first left");
    // A second sender connects, is accepted and greeted by the accept thread, sends and leaves,
    // all before this thread looks again.
    Sender::<u64>::connect(&path).unwrap().send(&2).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap(), 2);
}

#[test]
fn a_message_s_tensors_come_back_together_when_the_last_is_dropped() {
    let path = socket_path("together");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let sender = Sender::<Probe>::connect(&path).unwrap();
    let tensors = vec![Tensor::zeros(DType::U8, &[4096]).unwrap(), Tensor::zeros(DType::F32, &[64]).unwrap()];
    sender.send(&Probe { id: 1, tensors, expected: vec![], note: String::new() }).unwrap();
    let mut probe = receiver.recv().unwrap();
    assert_eq!(sender.outstanding_leases(), 1, "one lease per message");
    let kept = probe.tensors.pop().unwrap();
    drop(probe);
    sender.send(&probe_again()).unwrap();
    let again = receiver.recv().unwrap();
    drop(again);
    wait_until("the second message's lease", || sender.outstanding_leases() == 1);
    std::thread::sleep(Duration::from_millis(50)); // time for any release still in flight
    assert_eq!(sender.outstanding_leases(), 1, "one tensor of a message is still held, so the message stays leased");
    drop(kept);
    assert!(sender.wait_released(Duration::from_secs(10)), "the whole message comes back");
}

#[test]
fn a_spinning_receiver_gets_every_message_and_keeps_its_timeouts() {
    let path = socket_path("spin");
    let mut receiver = Receiver::<u64>::bind(&path).unwrap();
    receiver.set_spin(Duration::from_millis(5));
    let sender = Sender::<u64>::connect(&path).unwrap();
    let start = Instant::now();
    assert!(matches!(receiver.recv_timeout(Duration::from_millis(2)), Err(Error::Timeout)));
    assert!(start.elapsed() < Duration::from_secs(5), "the timeout was not kept");
    assert!(matches!(receiver.try_recv(), Err(Error::Empty)));
    let feeder = std::thread::spawn(move || {
        for i in 0..500u64 {
            sender.send(&i).unwrap();
        }
    });
    for i in 0..500u64 {
        assert_eq!(receiver.recv().unwrap(), i);
    }
    feeder.join().unwrap();
    assert!(matches!(receiver.recv(), Err(Error::Disconnected)));
}

#[test]
fn a_spinning_sender_takes_credits_and_releases_itself_and_a_full_queue_still_holds_it() {
    let path = socket_path("spin-sender");
    let mut receiver = Receiver::<Probe>::bind_with_capacity(&path, 2).unwrap();
    let sender = Arc::new(Sender::<Probe>::connect(&path).unwrap());
    sender.set_spin(Duration::from_millis(5));
    // Capacity 2: nearly every send finds no credit left and reads the receiver's frames itself.
    let feeder = sender.clone();
    let feeding = std::thread::spawn(move || {
        for id in 0..300 {
            feeder.send(&probe(id, id, 4096, None).unwrap()).unwrap();
        }
    });
    for id in 0..300 {
        let probe = receiver.recv().unwrap();
        assert_eq!(probe.id, id, "messages keep their order");
        assert_eq!(checksum(&probe.tensors[0]).unwrap(), probe.expected[0]);
    }
    feeding.join().unwrap();
    wait_until("every lease back", || sender.outstanding_leases() == 0);
    let sent = Arc::new(AtomicUsize::new(0));
    let (feeder, counter) = (sender.clone(), sent.clone());
    let feeding = std::thread::spawn(move || {
        for id in 0..3 {
            feeder.send(&probe(id, id, 64, None).unwrap()).unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    wait_until("two sends", || sent.load(Ordering::SeqCst) == 2);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(sent.load(Ordering::SeqCst), 2, "a spinning sender went through a full queue");
    receiver.recv().unwrap();
    feeding.join().unwrap();
}

/// A receiver dropped while holding one message's tensor, with two more messages it never read:
/// the sender hears it at once, takes back the two unread messages, and the held one only when
/// it is dropped (found by an outside test: before, a hang-up returned every lease at once, and
/// a dropped receiver left a blocked sender waiting for ever).
#[test]
fn a_dropped_receiver_gives_back_what_it_never_read_and_keeps_what_it_holds() {
    let path = socket_path("dropped");
    let mut receiver = Receiver::<Probe>::bind_with_capacity(&path, 4).unwrap();
    let sender = Sender::<Probe>::connect(&path).unwrap();
    for id in 0..3 {
        sender.send(&probe(id, id + 5, 100, None).unwrap()).unwrap();
    }
    let held = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    drop(receiver);
    wait_until("the unread messages' leases", || !sender.is_connected() && sender.outstanding_leases() == 1);
    assert!(matches!(sender.send(&probe_again()), Err(Error::Disconnected)));
    assert_eq!(checksum(&held.tensors[0]).unwrap(), held.expected[0], "what is held is intact");
    drop(held);
    assert!(sender.wait_released(Duration::from_secs(10)), "the held message comes back when dropped");
}

/// Found by an outside test: every receiver mapped the sender's whole host chunk read-write, so it
/// could change tensors the sender never sent it. Now a received host tensor is read-only unless
/// its sender made it writable on purpose, and a write through a writable one reaches the sender.
#[test]
fn received_host_tensors_are_read_only_unless_shared_writable() {
    let path = socket_path("read-only");
    let mut receiver = Receiver::<Vec<Tensor>>::bind(&path).unwrap();
    let sender = Sender::<Vec<Tensor>>::connect(&path).unwrap();
    let private = Tensor::from_slice(&[1.0f32, 2.0], DType::F32, &[2]).unwrap();
    let shared = Tensor::zeros_writable(DType::F32, &[2]).unwrap();
    sender.send(&vec![private.clone(), shared.clone()]).unwrap();
    let received = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(
        matches!(received[0].set(&[0], 9.0f32), Err(Error::ReadOnly)),
        "a read-only tensor cannot be written, and the error says why"
    );
    assert_eq!(received[0].to_vec::<f32>().unwrap(), [1.0, 2.0], "but it reads");
    received[1].set(&[1], 7.0f32).unwrap();
    assert_eq!(shared.get::<f32>(&[1]).unwrap(), 7.0, "a writable one is shared both ways");
}

/// A sender that claims routes it may not take, or that cannot be, gets each message refused
/// alone with the reason; its connection and the honest sender's go on.
#[test]
fn a_sender_that_lies_about_routes_is_refused_message_by_message() {
    use tensor_queue::Uuid;
    use tensor_queue::route::{Routing, Strictness};
    let lies = |path: &std::path::Path, claims: &[(Source, Fence)]| {
        let client = raw_client(path);
        let staging = SharedMemory::create("lying", 4096).unwrap();
        let announce = ToReceiver::Chunk {
            id: 5,
            len: 4096,
            kind: ChunkKind::Host,
            device: [0; 16],
            legacy: None,
            writable: false,
        };
        client.send(&announce.encode(), &[staging.fd().as_fd()]).unwrap();
        for (seq, &(source, fence)) in claims.iter().enumerate() {
            let tensors = one_tensor(source, fence);
            let message =
                ToReceiver::Message { seq: seq as u64 + 1, sent_ns: 0, encoded_ns: 0, tensors, payload: vec![] };
            client.send(&message.encode(), &[]).unwrap();
        }
        (client, staging)
    };
    let reasons = |receiver: &mut Receiver<Probe>, count: usize| -> String {
        let mut reasons = Vec::new();
        while reasons.len() < count {
            match receiver.recv_timeout(Duration::from_secs(10)) {
                Err(Error::Rejected { reason, .. }) => reasons.push(reason),
                other => panic!("expected a rejection, got {:?}", other.map(|p| p.id)),
            }
        }
        reasons.join("\n")
    };

    // A receiver that takes only zero-copy routes.
    let path = socket_path("route-lies-strict");
    let routing = Routing::default().strict(Strictness::ZeroCopy);
    let mut strict = Receiver::<Probe>::builder().routing(routing).bind(&path).unwrap();
    let signal = Fence::Signal { chunk: 5, offset: 0, value: 1 };
    let staged = |target| Source::Staged { chunk: 5, offset: 0, target: Uuid(target) };
    let _client = lies(&path, &[(staged([3; 16]), signal), (Source::Host { chunk: 5, offset: 0 }, signal)]);
    let said = reasons(&mut strict, 2);
    assert_eq!(said.matches("refused by this receiver's policy (ZeroCopy)").count(), 2, "{said}");

    // A receiver with the default policy: routes that do not fit the memory or the fence.
    let path = socket_path("route-lies");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let honest = Sender::<Probe>::connect(&path).unwrap();
    let _client = lies(
        &path,
        &[
            (Source::PeerMap { chunk: 5, offset: 0 }, Fence::None),
            (Source::Host { chunk: 5, offset: 0 }, Fence::None),
            (staged([9; 16]), signal),
        ],
    );
    let said = reasons(&mut receiver, 3);
    assert!(said.contains("with a host chunk"), "{said}");
    assert!(said.contains("without a host signal"), "{said}");
    assert!(said.contains("is not one of this process's"), "{said}");
    honest.send(&probe_again()).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().id, 2, "the honest sender is unaffected");
    assert!(receiver.take_errors().iter().all(|e| matches!(e, Error::Rejected { .. })), "no connection closed");
}

/// A host-route message waits for its producer's host word without holding up anyone: a sender
/// that never writes it stalls only its own message, which is delivered once the word is written.
#[test]
fn a_host_route_message_whose_word_is_never_written_holds_up_nobody_else() {
    let path = socket_path("route-parked");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let honest = Sender::<Probe>::connect(&path).unwrap();
    let stalled = raw_client(&path);
    let (data, word) =
        (SharedMemory::create("parked-data", 4096).unwrap(), SharedMemory::create("parked-word", 4096).unwrap());
    let host = |id, writable| ToReceiver::Chunk {
        id,
        len: 4096,
        kind: ChunkKind::Host,
        device: [0; 16],
        legacy: None,
        writable,
    };
    stalled.send(&host(5, false).encode(), &[data.fd().as_fd()]).unwrap();
    stalled.send(&host(6, true).encode(), &[word.fd().as_fd()]).unwrap();
    let tensors = one_tensor(Source::Host { chunk: 5, offset: 0 }, Fence::Signal { chunk: 6, offset: 0, value: 1 });
    let message = ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors, payload: vec![1] };
    stalled.send(&message.encode(), &[]).unwrap();
    std::thread::sleep(Duration::from_millis(50)); // read, and parked, before the honest message
    honest.send(&probe_again()).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().id, 2, "the honest message is not held up");
    assert!(matches!(receiver.recv_timeout(Duration::from_millis(100)), Err(Error::Timeout)), "still parked");
    word.write(0, &1u64.to_le_bytes()).unwrap(); // the producer's copy is done
    match receiver.recv_timeout(Duration::from_secs(10)) {
        Err(Error::Rejected { .. }) => {} // delivered: its one-byte payload is not a Probe, so refused
        other => panic!("expected the parked message, got {:?}", other.map(|p| p.id)),
    }
}

// ---------------------------------------------------------------------------------------------
// Careless peers (issue 22): each started as a separate program, `tq-hostile`.

/// Starts `tq-hostile <args>` with its stdout piped, for the test to read its lines.
fn hostile(args: &[&str]) -> (Child, std::io::Lines<std::io::BufReader<std::process::ChildStdout>>) {
    use std::io::BufRead as _;
    let mut child = Command::new(bin_path("tq-hostile").unwrap())
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

#[test]
fn a_message_of_another_type_is_rejected_alone_on_both_sides() {
    let path = socket_path("wrong-type");
    let mut receiver = Receiver::<Probe>::bind(&path).unwrap();
    let (mut child, lines) = hostile(&["wrong-type", path.to_str().unwrap()]);
    let error = receiver.recv_timeout(Duration::from_secs(30)).unwrap_err();
    let Error::Rejected { seq, reason, .. } = &error else { panic!("expected Error::Rejected, got {error:?}") };
    assert_eq!(*seq, 1);
    assert!(reason.contains("Probe") && !reason.trim_end().ends_with(':'), "a clear text: {reason}");
    assert!(receiver.take_errors().iter().any(|e| matches!(e, Error::Rejected { .. })), "take_errors has it too");
    let said: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(child.wait().unwrap().success(), "{said:?}");
    assert!(said.iter().any(|l| l.starts_with("rejected 1 ") && l.contains("Probe")), "the sender heard: {said:?}");
    // The channel goes on: an honest sender is served.
    let sender = Sender::<Probe>::connect(&path).unwrap();
    sender.send(&Probe { id: 5, tensors: Vec::new(), expected: Vec::new(), note: String::new() }).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(30)).unwrap().id, 5);
}

#[test]
fn several_senders_of_one_process_are_told_apart() {
    let path = socket_path("four-senders");
    let mut receiver = Receiver::<u64>::bind(&path).unwrap();
    receiver.expect_senders(4);
    let (mut child, _lines) = hostile(&["senders", path.to_str().unwrap(), "4", "50"]);
    let mut keys = std::collections::HashSet::new();
    let mut by_connection: std::collections::HashMap<u64, Vec<u64>> = std::collections::HashMap::new();
    loop {
        match receiver.recv_with_info(Some(Duration::from_secs(30))) {
            Ok((value, info)) => {
                assert!(keys.insert((info.sender_pid, info.connection, info.seq)), "a key seen twice: {info:?}");
                by_connection.entry(info.connection).or_default().push(value);
            }
            Err(Error::Disconnected) => break,
            Err(other) => panic!("{other}"),
        }
    }
    assert!(child.wait().unwrap().success());
    assert_eq!(keys.len(), 200, "every message has its own (pid, connection, seq)");
    assert_eq!(by_connection.len(), 4, "one connection number per sender");
    for values in by_connection.values() {
        let sender = values[0] / 1000;
        assert!(values.iter().all(|v| v / 1000 == sender), "one connection, one sender: {values:?}");
        assert_eq!(values.len(), 50);
    }
}

/// A receiver of the same user (root here, in CI) attacks the memory it was given read-only
/// with its own system calls: changing the file's mode (which an ordinary user, the file's
/// owner, may do too), reopening it for writing, mapping it writable, writing, punching holes,
/// `mprotect`. Every one is refused, and the sender's tensors, the one sent and one that shares
/// its chunk but was never sent, keep their bytes.
#[test]
fn a_receiver_cannot_make_read_only_host_memory_writable() {
    let path = socket_path("attack-received");
    let (mut child, mut lines) = hostile(&["attack-received", path.to_str().unwrap()]);
    assert_eq!(lines.next().unwrap().unwrap(), "listening");
    let sender = Sender::<Tensor>::connect(&path).unwrap();
    let sent = Tensor::from_slice(&[1u8; 4096], DType::U8, &[4096]).unwrap();
    let never_sent = Tensor::from_slice(&[2u8; 4096], DType::U8, &[4096]).unwrap();
    sender.send(&sent).unwrap();
    let said: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(child.wait().unwrap().success(), "{said:?}");
    assert!(said.iter().any(|l| l.starts_with("refused")), "the attacks ran: {said:?}");
    assert!(!said.iter().any(|l| l.starts_with("wrote")), "a write got through: {said:?}");
    assert_eq!(sent.to_vec::<u8>().unwrap(), [1u8; 4096], "the sent tensor is intact");
    assert_eq!(never_sent.to_vec::<u8>().unwrap(), [2u8; 4096], "its chunk neighbour is intact");
}

/// The same attack by an ordinary user: as root, this test runs the one above again in a copy
/// of this test binary whose sender and hostile receiver both run as `nobody` (the owner of
/// the memory, who may `fchmod` it); as an ordinary user already, the test above is that case.
#[test]
fn a_receiver_cannot_make_read_only_host_memory_writable_as_an_ordinary_user() {
    use std::os::unix::process::CommandExt as _;
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: a_receiver_cannot_make_read_only_host_memory_writable ran as this ordinary user");
        return;
    }
    const NOBODY: u32 = 65534;
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_receiver_cannot_make_read_only_host_memory_writable", "--test-threads=1"])
        .env("IPC_TESTS_BIN_DIR", bin_path("tq-hostile").unwrap().parent().unwrap())
        .env("TMPDIR", "/tmp")
        .gid(NOBODY)
        .uid(NOBODY)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "as uid {NOBODY}: {text}{}", String::from_utf8_lossy(&output.stderr));
    assert!(text.contains("1 passed"), "the attack test ran as uid {NOBODY}: {text}");
}

/// `try_send` and `send_timeout` keep their promise whatever the message's size: with credits
/// available, a message of 1 MiB of plain data (more than the socket holds) is taken at once
/// while the receiver is not inside `recv`, and arrives whole.
#[test]
fn non_blocking_sends_of_large_messages_return_at_once() {
    let path = socket_path("large-try-send");
    let mut receiver = Receiver::<Vec<u8>>::bind(&path).unwrap();
    let sender = Sender::<Vec<u8>>::connect(&path).unwrap();
    sender.wait_ready(Duration::from_secs(10)).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    let sending = sender.clone();
    std::thread::spawn(move || {
        let tried = sending.try_send(&vec![1u8; 1 << 20]);
        let timed = sending.send_timeout(&vec![2u8; 1 << 20], Duration::from_millis(100));
        let _ = done.send((tried.is_ok(), timed.is_ok()));
    });
    let outcome = finished.recv_timeout(Duration::from_secs(10));
    assert_eq!(outcome, Ok((true, true)), "try_send and send_timeout returned Ok at once (not blocked)");
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap(), vec![1u8; 1 << 20]);
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap(), vec![2u8; 1 << 20]);
}

/// Two processes that each send a large message to the other before receiving do not wait for
/// each other (the other process is `tq-hostile exchange`).
#[test]
fn two_processes_that_each_send_first_do_not_deadlock() {
    let (ours, theirs) = (socket_path("exchange-ours"), socket_path("exchange-theirs"));
    let mut receiver = Receiver::<Vec<u8>>::bind(&ours).unwrap();
    let (mut child, mut lines) = hostile(&["exchange", theirs.to_str().unwrap(), ours.to_str().unwrap()]);
    assert_eq!(lines.next().unwrap().unwrap(), "listening");
    let sender = Sender::<Vec<u8>>::connect(&theirs).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let sent = sender.send(&vec![4u8; 8 << 20]).is_ok();
        let _ = done.send(sent);
        sender
    });
    assert_eq!(finished.recv_timeout(Duration::from_secs(20)), Ok(true), "our send returned");
    assert_eq!(receiver.recv_timeout(Duration::from_secs(30)).unwrap(), vec![3u8; 8 << 20]);
    let said: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(said.contains(&format!("received {}", 8 << 20)), "{said:?}");
    assert!(child.wait().unwrap().success(), "{said:?}");
}

/// A receiver that runs out of descriptors while a new chunk's descriptor is on its way does not
/// lose the message whose `send` returned `Ok`: it is refused alone, on both sides, with a text
/// that names the limit, and the connection goes on. Once the receiver has descriptors again,
/// later messages in that same chunk arrive: the sender, told the descriptor was lost, announces
/// the chunk again (before, the chunk stayed refused on that connection for good).
#[test]
fn a_receiver_out_of_descriptors_refuses_the_message_and_goes_on() {
    let path = socket_path("fd-starved");
    let (mut child, mut lines) = hostile(&["fd-starved", path.to_str().unwrap()]);
    let mut next = || lines.next().expect("a line").expect("a line");
    assert_eq!(next(), "listening");
    let sender = Sender::<Tensor>::connect(&path).unwrap();
    sender.send(&Tensor::zeros(DType::U8, &[16]).unwrap()).unwrap();
    assert_eq!(next(), "got 16");
    assert_eq!(next(), "starved");
    // A new sender is told at once, not left waiting in the backlog.
    let newcomer = Sender::<Tensor>::connect(&path).unwrap();
    match newcomer.wait_ready(Duration::from_secs(20)) {
        Err(Error::PeerRefused(Refusal::ByPeer(why))) => assert!(why.contains("descriptors"), "{why}"),
        other => panic!("expected a refusal that names the cause, got {other:?}"),
    }
    // 65 MiB: a chunk of its own, whose descriptor cannot fit the receiver's table.
    let big = Tensor::zeros(DType::U8, &[65 << 20]).unwrap();
    sender.send(&big).expect("the send is taken");
    let said = next();
    assert!(said.starts_with("rejected") && said.contains("open files"), "refused with why: {said}");
    let mut rejected = Vec::new();
    wait_until("the sender hears of the refusal", || {
        rejected.extend(sender.take_rejected());
        !rejected.is_empty()
    });
    assert!(rejected[0].reason.contains("open files"), "{:?}", rejected[0].reason);
    assert_eq!(next(), "recovered");
    sender.send(&Tensor::zeros(DType::U8, &[32]).unwrap()).expect("the connection goes on");
    assert_eq!(next(), "got 32");
    // The very chunk whose announcement was lost: the tensor again, and a view into it.
    sender.send(&big).unwrap();
    assert_eq!(next(), format!("got {}", 65 << 20), "a message in the chunk whose descriptor was lost");
    sender.send(&big.narrow(0, 1 << 20, 4096).unwrap()).unwrap();
    assert_eq!(next(), "got 4096");
    assert!(sender.take_rejected().is_empty(), "refused only while the receiver had no descriptor free");
    drop((sender, newcomer));
    assert_eq!(next(), "done");
    assert!(child.wait().unwrap().success());
}

/// A source taken out of a `Select` is never ready again, even while its receiver lives and has
/// a message waiting (the `Select` registers each source once, and takes it out on `remove`);
/// the others still are.
#[test]
fn a_source_removed_from_a_select_is_never_ready_again() {
    use tensor_queue::channel::Select;
    let (a_path, b_path) = (socket_path("select-removed-a"), socket_path("select-removed-b"));
    let mut a = Receiver::<u32>::bind(&a_path).unwrap();
    let mut b = Receiver::<u32>::bind(&b_path).unwrap();
    let mut select = Select::new();
    let (from_a, from_b) = (select.add(&a).unwrap(), select.add(&b).unwrap());
    select.remove(from_a);
    let sender_a = Sender::<u32>::connect(&a_path).unwrap();
    sender_a.send(&1).unwrap();
    // `a` is readable now: a `Select` of its own says so.
    let mut only_a = Select::new();
    only_a.add(&a).unwrap();
    only_a.ready_timeout(Duration::from_secs(10)).expect("a's message makes it readable");
    assert!(matches!(select.try_ready(), Err(Error::Empty)), "the removed source was reported");
    Sender::<u32>::connect(&b_path).unwrap().send(&2).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        assert_eq!(select.ready_timeout(Duration::from_secs(10)).unwrap(), from_b, "only b is in the set");
        match b.try_recv() {
            Ok(n) => break n,
            Err(Error::Empty) => assert!(Instant::now() < deadline, "b's message never came"),
            Err(other) => panic!("{other}"),
        }
    };
    assert_eq!(got, 2);
    assert_eq!(a.recv().unwrap(), 1);
}
