//! Round 10 of the outside tests (Rust): what an outside tester found with only the README and
//! the API docs, as tests of the public API. Every wait is bounded; no bound is a speed assertion.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use integration_tests::{socket_path, within};
use tensor_queue::{Receiver, Sender};

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
