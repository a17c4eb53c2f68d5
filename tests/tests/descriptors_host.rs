//! What a connection costs in descriptors (a test binary of its own: it counts every
//! descriptor of the process, so no other test may run beside it).

use std::time::Duration;

use tensor_queue::{Receiver, Tensor};

type Item = (u64, Vec<Tensor>);

/// Descriptors this process holds now.
fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// What a local connection costs in descriptors, both ends in this process, once its rings are
/// on. The bug this fixed: each sender also made a poll set for its reader
/// thread that a local link never waits on (one descriptor per sender wasted; a process of many
/// senders ran out sooner).
#[test]
fn a_local_connection_costs_its_ends_only_the_descriptors_it_uses() {
    let path = integration_tests::socket_path("fd-cost");
    let mut receiver = Receiver::<Item>::builder().capacity(4).bind(&path).unwrap();
    // The first connection makes what a process makes once (its threads' descriptors, a chunk).
    let first = tensor_queue::Sender::<Item>::connect(&path).unwrap();
    let tensor = Tensor::from_slice(&[1u8, 2, 3], tensor_queue::DType::U8, &[3]).unwrap();
    first.send(&(0, vec![tensor.clone()])).unwrap();
    receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    let before = open_descriptors();
    let senders: Vec<_> = (1..=20u64)
        .map(|i| {
            let sender = tensor_queue::Sender::<Item>::connect(&path).unwrap();
            sender.send(&(i, vec![tensor.clone()])).unwrap();
            receiver.recv_timeout(Duration::from_secs(30)).unwrap();
            sender
        })
        .collect();
    let per_connection = (open_descriptors() - before) as f64 / senders.len() as f64;
    // Measured: 2 sockets, 4 ring memory files, 4 doorbells and 2 more eventfds, 2 poll sets
    // (one per link) = 14; 15 before the fix (the sender reader thread's own poll set).
    assert!(per_connection <= 14.0, "{per_connection} descriptors per connection, both ends");
}
