//! Round 10 of the outside tests (Rust): what an outside tester found with only the README and
//! the API docs, as tests of the public API. Every wait is bounded; no bound is a speed assertion.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use integration_tests::program::pattern;
use integration_tests::{socket_path, within};
use tensor_queue::{DType, Error, Receiver, Refusal, Secret, Sender, Tensor};

/// The voluntary context switches of the calling thread so far (`/proc/thread-self/status`).
fn my_switches() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// 200 threads share one `Sender` to a receiver with room for 4 messages, so that nearly all of
/// them wait for a credit at any time: each credit wakes one of them. (Each woke all: about 200
/// switches per message, 20x slower than 200 `Sender`s of their own.) Counted as the sending
/// threads' own voluntary context switches, not time.
#[test]
fn threads_sharing_a_sender_that_wait_for_room_are_woken_one_per_credit() {
    const THREADS: usize = 200;
    const EACH: u32 = 20;
    let path = socket_path("round10-shared");
    let mut rx = Receiver::<(u32, u32)>::builder().capacity(4).bind(&path).unwrap();
    let tx = Sender::<(u32, u32)>::connect(&path).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS as u32)
        .map(|who| {
            let (tx, barrier) = (tx.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                let before = my_switches();
                for n in 0..EACH {
                    tx.send_timeout(&(who, n), Duration::from_secs(60)).unwrap();
                }
                my_switches() - before
            })
        })
        .collect();
    drop(tx);
    let counts = within(Duration::from_secs(120), "receiving every message", move || {
        let mut next = vec![0u32; THREADS];
        for message in rx.iter() {
            let (who, n) = message.unwrap();
            assert_eq!(n, next[who as usize], "thread {who}'s messages in order");
            next[who as usize] += 1;
        }
        next
    });
    assert!(counts.iter().all(|&c| c == EACH), "every message arrives: {counts:?}");
    let switches: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let messages = (THREADS as u64) * EACH as u64;
    println!("{switches} voluntary switches of the sending threads for {messages} messages");
    assert!(
        switches < 10 * messages,
        "the waiting threads were woken {:.1} times per message: more than the one a credit needs",
        switches as f64 / messages as f64
    );
}

/// A TCP receiver of tensor lists on a free loopback port, and a sender connected to it.
fn tcp_pair() -> (Receiver<Vec<Tensor>>, Sender<Vec<Tensor>>) {
    let secret = || Secret::from_bytes(*b"round10-tester-secret-0123456789").unwrap();
    let rx = Receiver::<Vec<Tensor>>::builder().secret(secret()).bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", rx.local_addr().unwrap().port());
    let tx = Sender::<Vec<Tensor>>::builder().secret(secret()).connect(&endpoint).unwrap();
    (rx, tx)
}

/// Over TCP, views of one storage (clones, slices, a flip) in one message cross once and stay
/// views of one storage. (Each went on its own: 130 clones of 32 MiB were refused as over 4 GiB,
/// ten cost 320 MiB at the receiver, and a write through one no longer showed in another.)
#[test]
fn tcp_views_of_one_storage_cross_once_and_stay_views_of_one_storage() {
    let (mut rx, tx) = tcp_pair();
    let len = 32 << 20;
    let whole = Tensor::new(&pattern(len, 10), &[len]).unwrap();
    let other = Tensor::new(&pattern(4096, 11), &[4096]).unwrap();
    let mut message = vec![whole.clone(); 130];
    message.push(whole.slice(0, 1000, 2_000_000, 3).unwrap());
    message.push(other.clone());
    message.push(whole.flip(&[0]).unwrap());
    message.push(whole.narrow(0, len as u64 - 16, 16).unwrap());
    tx.send_timeout(&message, Duration::from_secs(60)).expect("32 MiB of bytes, in 134 views");
    let got = within(Duration::from_secs(120), "the message of views", move || {
        rx.recv_timeout(Duration::from_secs(60)).unwrap()
    });
    assert_eq!(got.len(), message.len());
    for (index, (sent, received)) in message.iter().zip(&got).enumerate() {
        assert_eq!(received.shape(), sent.shape(), "view {index}");
    }
    for index in [0, 130, 131, 132, 133] {
        assert_eq!(got[index].to_vec::<u8>().unwrap(), message[index].to_vec::<u8>().unwrap(), "view {index}'s bytes");
    }
    let address = |t: &Tensor| t.host_address().unwrap().0 as usize;
    assert!(got[..130].iter().all(|t| address(t) == address(&got[0])), "the clones are one tensor's memory");
    assert_eq!(address(&got[130]), address(&got[0]) + 1000, "the slice lies in it");
    assert_eq!(address(&got[132]), address(&got[0]) + len - 1, "the flip's element 0 is the last byte");
    assert_eq!(address(&got[133]), address(&got[0]) + len - 16);
    assert_ne!(address(&got[131]), address(&got[0]), "another storage is another piece");
    // A write through one view shows in the others, as for the sender's views.
    let before = got[130].get::<u8>(&[0]).unwrap();
    got[0].set::<u8>(&[1000], before.wrapping_add(1)).unwrap();
    assert_eq!(got[130].get::<u8>(&[0]).unwrap(), before.wrapping_add(1));
    assert_eq!(got[7].get::<u8>(&[1000]).unwrap(), before.wrapping_add(1));
}

/// Over TCP, views of one storage that do not overlap cross as the bytes each touches, not as
/// everything from the first to the last (two 1 KiB ends of a storage over 4 GiB were refused as
/// over 4 GiB, and of 1 GiB cost 1 GiB on the wire and at the receiver).
#[test]
fn tcp_views_far_apart_in_one_storage_cross_as_their_own_bytes() {
    let (mut rx, tx) = tcp_pair();
    let len = (4u64 << 30) + 4096;
    let big = Tensor::zeros(DType::U8, &[len]).unwrap(); // zeros: no page is touched here
    let ends = vec![big.narrow(0, 0, 1024).unwrap(), big.narrow(0, len - 1024, 1024).unwrap()];
    tx.send_timeout(&ends, Duration::from_secs(60)).expect("2 KiB of views of one storage");
    let got =
        within(Duration::from_secs(120), "the two ends", move || rx.recv_timeout(Duration::from_secs(60)).unwrap());
    assert_eq!(got.len(), 2);
    for end in &got {
        assert_eq!(end.to_vec::<u8>().unwrap(), vec![0u8; 1024]);
    }
}

/// A Unix socket where something else listens and answers with bytes that are no greeting:
/// connecting says so (`PeerRefused`, as over TCP), not `Disconnected` as if a receiver had gone.
#[test]
fn connecting_to_a_unix_socket_that_answers_garbage_is_refused_as_no_receiver() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType, accept, bind, listen, send, socket};
    let path = socket_path("round10-garbage");
    let listener = socket(AddressFamily::UNIX, SocketType::SEQPACKET, None).unwrap();
    bind(&listener, &SocketAddrUnix::new(&path).unwrap()).unwrap();
    listen(&listener, 8).unwrap();
    let server = thread::spawn(move || {
        let peer = accept(&listener).unwrap();
        send(&peer, &[0xff; 64], rustix::net::SendFlags::empty()).unwrap();
        thread::sleep(Duration::from_secs(2)); // held open: garbage, not a hang-up
    });
    let outcome = within(Duration::from_secs(60), "connecting to a non-receiver", move || {
        Sender::<u32>::builder().timeout(Duration::from_secs(20)).connect(&path).and_then(|tx| tx.send(&1))
    });
    match outcome {
        Err(Error::PeerRefused(Refusal::NotAReceiver(why))) => assert!(!why.is_empty()),
        other => panic!("garbage for a greeting: {other:?}"),
    }
    server.join().unwrap();
}
