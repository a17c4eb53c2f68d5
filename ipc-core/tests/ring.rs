//! The shared-memory ring between two real processes: a million records streamed, round trips,
//! and a peer killed while the survivor writes, reads or sleeps.
//!
//! `child` is the other process's side: this binary starts itself with [`ROLE`] set and that one
//! test selected, its socket inherited ([`ipc_core::inherit`]); run normally, `child` does
//! nothing. Only the public API is used.

use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ipc_core::inherit::{spawn_with_sockets, take_inherited_sockets};
use ipc_core::ring::{self, RingError, RingReader, RingWriter, Wakeup};
use ipc_core::seqpacket::Connection;

const ROLE: &str = "IPC_CORE_RING_TEST_ROLE";
const SOCKETS: &str = "IPC_CORE_RING_TEST_SOCKETS";
/// Only a guard against hangs; nothing here is timed.
const PATIENCE: Duration = Duration::from_secs(60);
const STREAMED: u64 = 1_000_000;
const ROUND_TRIPS: u64 = 10_000;
const CAPACITY: usize = 1 << 16;

/// Record `index`: its number, then up to 199 bytes that depend on it.
fn record(index: u64) -> Vec<u8> {
    let mut bytes = index.to_le_bytes().to_vec();
    bytes.extend((0..index % 200).map(|byte| (index as u8).wrapping_add(byte as u8)));
    bytes
}

/// The number of a record, checking that it is whole.
fn check(bytes: &[u8]) -> u64 {
    let index = u64::from_le_bytes(bytes[..8].try_into().expect("a record has its number"));
    assert_eq!(bytes, record(index), "record {index} is whole");
    index
}

/// Starts this binary as the peer with `role`, and sets up the rings with it.
fn start(role: &str) -> (Child, Connection, RingWriter, RingReader) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    // Its panics still show (stderr); its test harness's chatter does not.
    command.args(["--exact", "child", "--nocapture", "--test-threads=1"]).env(ROLE, role).stdout(Stdio::null());
    let (child, mut sockets) = spawn_with_sockets(&mut command, SOCKETS, 1).unwrap();
    let socket = sockets.pop().unwrap();
    let (writer, reader) = ring::offer(&socket, CAPACITY).unwrap();
    (child, socket, writer, reader)
}

/// Pops the next record, failing on anything but a record.
fn pop(reader: &mut RingReader, out: &mut Vec<u8>, socket: &Connection) -> u64 {
    match reader.pop(out, Some(PATIENCE), Some(socket.as_fd())).unwrap() {
        Wakeup::Ready => check(out),
        other => panic!("waiting for a record: {other:?}"),
    }
}

fn push(writer: &mut RingWriter, bytes: &[u8], socket: &Connection) {
    assert_eq!(writer.push_waiting(bytes, Some(PATIENCE), Some(socket.as_fd())).unwrap(), Wakeup::Ready);
}

#[test]
fn a_million_records_stream_and_round_trips_echo() {
    let (mut child, socket, mut writer, mut reader) = start("echo");
    for index in 0..STREAMED {
        push(&mut writer, &record(index), &socket);
    }
    let mut out = Vec::new();
    assert_eq!(pop(&mut reader, &mut out, &socket), STREAMED, "the child counted every record, in order");
    for index in 0..ROUND_TRIPS {
        push(&mut writer, &record(index), &socket);
        assert_eq!(pop(&mut reader, &mut out, &socket), index);
    }
    drop(socket); // the child's watched socket hangs up: it exits
    assert!(child.wait().unwrap().success());
}

/// The child streams without end; we kill it at a moment we do not choose (while it pushes or
/// sleeps for room) and read on: every record is whole and in order, then the hang-up.
#[test]
fn a_writer_killed_mid_stream_leaves_whole_records_then_the_hang_up() {
    let (child, socket, _writer, reader) = start("flood");
    read_until_killed(child, socket, reader);
}

/// The same with the reader asleep on an eventfd doorbell that the child's writer rings.
#[test]
fn a_writer_killed_mid_stream_wakes_a_reader_on_a_doorbell() {
    let (child, socket, _writer, mut reader) = start("flood-with-doorbell");
    let bell = ring::doorbell().unwrap();
    socket.send(b"doorbell", &[bell.as_fd()]).unwrap();
    reader.set_doorbell(Some(bell)).unwrap();
    read_until_killed(child, socket, reader);
}

fn read_until_killed(mut child: Child, socket: Connection, mut reader: RingReader) {
    let mut out = Vec::new();
    let mut expected = 0;
    while expected < 20_000 {
        assert_eq!(pop(&mut reader, &mut out, &socket), expected);
        expected += 1;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    loop {
        match reader.pop(&mut out, Some(PATIENCE), Some(socket.as_fd())).unwrap() {
            Wakeup::Ready => {
                assert_eq!(check(&out), expected, "in order after the kill");
                expected += 1;
            }
            Wakeup::Watched => break,
            Wakeup::TimedOut => panic!("the dead writer's socket never hung up"),
        }
    }
    assert_eq!(socket.recv(&mut [0u8; 8]).unwrap().0, 0, "the watched socket says hang-up");
    assert!(!reader.try_pop(&mut out).unwrap(), "and nothing else came");
}

/// The child reads a little, answers, then stops reading; we fill the ring and sleep for room,
/// and are woken by its death (not by a timeout), as is a reader that waits for it.
#[test]
fn a_reader_killed_while_we_wait_for_room_wakes_us() {
    let (mut child, socket, mut writer, mut reader) = start("stall");
    let mut out = Vec::new();
    assert_eq!(pop(&mut reader, &mut out, &socket), 7, "the child is up");
    let mut index = 0;
    let full = loop {
        match writer.push(&record(index)) {
            Ok(()) => index += 1,
            Err(full @ RingError::Full { .. }) => break full,
            Err(other) => panic!("{other}"),
        }
    };
    assert!(index > 100, "{full}");
    let pid = child.id();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100)); // let the writer sleep on the futex
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid as i32).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
    });
    let woken = writer.push_waiting(&record(index), Some(PATIENCE), Some(socket.as_fd())).unwrap();
    assert_eq!(woken, Wakeup::Watched, "the dead reader's socket woke the sleeping writer");
    killer.join().unwrap();
    child.wait().unwrap();
    assert_eq!(reader.pop(&mut out, Some(PATIENCE), Some(socket.as_fd())).unwrap(), Wakeup::Watched);
}

/// A peer that sends something else than an offer, or hangs up, is refused by `accept`.
#[test]
fn accept_refuses_what_is_not_an_offer() {
    let (ours, theirs) = Connection::pair().unwrap();
    ours.send(b"hello", &[]).unwrap();
    assert!(matches!(ring::accept(&theirs), Err(ipc_core::Error::Ring(RingError::Corrupt { .. }))));
    let memfd = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    ours.send(b"ipc-core ring pair v1", &[memfd.as_fd()]).unwrap();
    assert!(matches!(ring::accept(&theirs), Err(ipc_core::Error::Ring(RingError::Corrupt { .. }))), "one file");
    drop(ours);
    assert!(matches!(ring::accept(&theirs), Err(ipc_core::Error::PeerGone)));
}

/// The other process (see the module docs).
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let mut sockets: Vec<OwnedFd> = take_inherited_sockets(SOCKETS).unwrap();
    let socket = Connection::from(sockets.pop().unwrap());
    let (mut writer, mut reader) = ring::accept(&socket).unwrap();
    let mut out = Vec::new();
    match role.as_str() {
        "echo" => {
            for index in 0..STREAMED {
                assert_eq!(pop(&mut reader, &mut out, &socket), index);
            }
            push(&mut writer, &record(STREAMED), &socket);
            loop {
                match reader.pop(&mut out, None, Some(socket.as_fd())).unwrap() {
                    Wakeup::Ready => push(&mut writer, &out, &socket),
                    _ => return, // the parent hung up
                }
            }
        }
        "flood" | "flood-with-doorbell" => {
            if role == "flood-with-doorbell" {
                let (_, mut fds) = socket.recv(&mut [0u8; 16]).unwrap();
                writer.set_doorbell(fds.pop()).unwrap();
            }
            for index in 0.. {
                push(&mut writer, &record(index), &socket);
            }
        }
        "stall" => {
            push(&mut writer, &record(7), &socket);
            // Reads no more; killed long before the parent would hang up.
            ipc_core::seqpacket::wait_readable(socket.as_fd(), PATIENCE).unwrap();
        }
        other => panic!("unknown role {other}"),
    }
}
