//! What tests that speak the wire by hand (hostile and outside peers, through
//! `tensor_queue::testing::wire`) need first: a `Hello`, and a raw client past the handshake.

use std::path::Path;
use std::time::Duration;

use ipc_core::seqpacket::Connection;
use tensor_queue::testing::wire::{Frame, Hello, LinkFrame};

/// A `Hello` of this process on this machine, granting (as a receiver) or announcing (as a
/// sender) `capacity`, with the random `instance` a process gives its `Hello`s.
pub fn hello(capacity: u32, instance: u64) -> Hello {
    Hello {
        pid: std::process::id(),
        host: ipc_core::HostId::current().expect("this machine's id").0,
        capacity,
        instance,
        reach: Default::default(),
        routing: Default::default(),
    }
}

/// A raw client of the receiver at `path` that did the handshake correctly (its `Hello` said,
/// the receiver's read), so that its later frames reach validation. Its reads wait 10 s at most.
pub fn raw_client(path: &Path) -> Connection {
    let connection = Connection::connect(path).unwrap();
    connection.send(&hello(0, 0x7e57).encode(), &[]).unwrap();
    connection.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
    // The receiver's `Hello`, after its offer of rings (a link frame, passed over: this client
    // stays on the socket).
    let mut buf = [0u8; 256];
    loop {
        let (n, _) = connection.recv(&mut buf).unwrap();
        if LinkFrame::decode(&buf[..n]).is_err() {
            break;
        }
    }
    connection
}
