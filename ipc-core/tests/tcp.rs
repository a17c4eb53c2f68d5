//! The authenticated TCP link over real sockets on 127.0.0.1, one peer in another process.
//!
//! `child_peer` is the other process's side: this binary starts itself with [`CHILD_ENV`] set and
//! that one test selected; run normally, `child_peer` does nothing.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use ipc_core::Error;
use ipc_core::tcp::{HandshakeAbort, MAX_MESSAGE, SECRET_ENV, Secret, TcpLink, TcpListener, TurnAway};
use sha2::Sha256;

const KEY: &[u8] = b"0123456789abcdef-test-secret";
const CHILD_ENV: &str = "TQ_TCP_TEST_CHILD_ADDR";
/// How the child ends (see [`child_peer`]).
const CHILD_MODE_ENV: &str = "TQ_TCP_TEST_CHILD_MODE";
/// Only a guard against hangs; nothing here is timed.
const PATIENCE: Duration = Duration::from_secs(30);

fn secret(key: &[u8]) -> Secret {
    Secret::from_bytes(key).unwrap()
}

fn listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").unwrap()
}

/// Accepts one connection on another thread; its result comes back through the receiver.
fn accept_in_background(
    listener: TcpListener,
    key: &'static [u8],
) -> mpsc::Receiver<(ipc_core::Result<TcpLink>, TcpListener)> {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let accepted = listener.accept(Some(PATIENCE), &secret(key));
        let _ = done.send((accepted, listener));
    });
    result
}

/// Sends `bytes` from `from` and returns what `to` receives.
fn carried(from: &TcpLink, to: &TcpLink, bytes: &[u8]) -> Vec<u8> {
    from.send(bytes).unwrap();
    let mut buf = Vec::new();
    to.recv(&mut buf, Some(PATIENCE)).unwrap();
    buf
}

/// The client side of `tq-auth-v1` written out by hand from the module's docs, so the tests can
/// send what `TcpLink` never would. Returns the bytes it sent.
fn handshake_by_hand(stream: &mut TcpStream, key: &[u8]) -> Vec<u8> {
    let nonce = [0x5a; 32];
    let mut sent = b"tq-auth-v1C".to_vec();
    sent.extend_from_slice(&nonce);
    stream.write_all(&sent).unwrap();
    let mut hello = [0u8; 43];
    stream.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..11], b"tq-auth-v1S");
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
    mac.update(b"tq-auth-v1C");
    mac.update(&nonce);
    mac.update(&hello[11..]);
    let answer = mac.finalize().into_bytes();
    stream.write_all(&answer).unwrap();
    sent.extend_from_slice(&answer);
    let mut theirs = [0u8; 32];
    stream.read_exact(&mut theirs).unwrap();
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
    mac.update(b"tq-auth-v1S");
    mac.update(&hello[11..]);
    mac.update(&nonce);
    mac.verify_slice(&theirs).expect("the listener's answer checks out");
    sent
}

#[test]
fn the_right_secret_connects_both_ways_and_messages_round_trip() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let client = TcpLink::connect(addr, &secret(KEY), PATIENCE).unwrap();
    let (server, _listener) = accepted.recv_timeout(PATIENCE).unwrap();
    let server = server.unwrap();
    assert_eq!(server.peer_addr(), client.local_addr().unwrap());

    let mut buf = Vec::new();
    match server.recv(&mut buf, Some(Duration::from_millis(20))) {
        Err(Error::Os { source, .. }) => assert_eq!(source.kind(), std::io::ErrorKind::TimedOut),
        other => panic!("nothing was sent, yet {other:?}"),
    }
    client.send(b"ping").unwrap();
    server.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert_eq!(buf, b"ping");
    let big: Vec<u8> = (0..3 << 20).map(|i: u32| i as u8).collect();
    server.send(b"").unwrap();
    server.send(&big).unwrap();
    client.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert!(buf.is_empty());
    client.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert!(buf == big, "the 3 MiB message came back altered");
    assert!(matches!(client.send(&vec![0; MAX_MESSAGE + 1]), Err(Error::MessageTooLarge { max: MAX_MESSAGE, .. })));
    client.send(b"still fine").unwrap();
    server.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert_eq!(buf, b"still fine", "a refused oversize send left nothing on the wire");
    drop(client);
    assert!(matches!(server.recv(&mut buf, Some(PATIENCE)), Err(Error::PeerGone)));
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let client = TcpLink::connect(addr, &secret(b"another secret of enough bytes"), PATIENCE);
    assert!(matches!(client, Err(Error::AuthFailed { .. })), "{client:?}");
    let (server, listener) = accepted.recv_timeout(PATIENCE).unwrap();
    assert!(matches!(server, Err(Error::AuthFailed { peer, .. }) if peer.ip().is_loopback()), "{server:?}");

    let accepted = accept_in_background(listener, KEY);
    TcpLink::connect(addr, &secret(KEY), PATIENCE).expect("the listener goes on after a refusal");
    accepted.recv_timeout(PATIENCE).unwrap().0.unwrap();
}

#[test]
fn a_silent_connector_times_out_and_the_next_one_is_accepted() {
    let listener = listener().with_handshake_timeout(Duration::from_millis(300));
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let mut silent = TcpStream::connect(addr).unwrap();
    let (server, listener) = accepted.recv_timeout(PATIENCE).expect("accept is bounded by the handshake timeout");
    match server {
        Err(Error::HandshakeTimeout { timeout, .. }) => assert_eq!(timeout, Duration::from_millis(300)),
        other => panic!("{other:?}"),
    }
    silent.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut rest = Vec::new();
    silent.read_to_end(&mut rest).expect("the listener closed the silent connection");
    assert_eq!(rest.len(), 43, "only the listener's greeting, nothing computed from the secret");

    let accepted = accept_in_background(listener, KEY);
    let client = TcpLink::connect(addr, &secret(KEY), PATIENCE).unwrap();
    let server = accepted.recv_timeout(PATIENCE).unwrap().0.unwrap();
    assert_eq!(carried(&client, &server, b"after"), b"after");
}

/// A listener that cannot take a connection (out of descriptors) says so in place of its
/// challenge: the connector learns why, and it is not mistaken for a wrong secret.
#[test]
fn a_connector_turned_away_learns_why() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let turning = std::thread::spawn(move || {
        listener.accept_unverified(Some(PATIENCE)).unwrap().turn_away(TurnAway::OutOfDescriptors)
    });
    let refused = TcpLink::connect(addr, &secret(KEY), PATIENCE).unwrap_err();
    turning.join().unwrap();
    assert!(matches!(refused, Error::TurnedAway { why: TurnAway::OutOfDescriptors, .. }), "{refused:?}");
    assert!(refused.to_string().contains("descriptors"), "{refused}");
}

#[test]
fn garbage_before_the_handshake_is_refused() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let mut garbage = TcpStream::connect(addr).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n").unwrap();
    let (server, _listener) = accepted.recv_timeout(PATIENCE).unwrap();
    assert!(matches!(server, Err(Error::AuthFailed { .. })), "{server:?}");
}

#[test]
fn a_replayed_handshake_is_refused() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let mut honest = TcpStream::connect(addr).unwrap();
    let recorded = handshake_by_hand(&mut honest, KEY);
    let (server, listener) = accepted.recv_timeout(PATIENCE).unwrap();
    server.expect("the hand-written handshake follows the documented protocol");

    let accepted = accept_in_background(listener, KEY);
    let mut replay = TcpStream::connect(addr).unwrap();
    replay.write_all(&recorded).unwrap();
    let (server, _listener) = accepted.recv_timeout(PATIENCE).unwrap();
    assert!(matches!(server, Err(Error::AuthFailed { .. })), "{server:?}");
}

#[test]
fn an_oversize_length_prefix_is_refused() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let mut raw = TcpStream::connect(addr).unwrap();
    handshake_by_hand(&mut raw, KEY);
    let server = accepted.recv_timeout(PATIENCE).unwrap().0.unwrap();
    raw.write_all(&(MAX_MESSAGE as u32 + 1).to_le_bytes()).unwrap();
    let mut buf = Vec::new();
    match server.recv(&mut buf, Some(PATIENCE)) {
        Err(Error::MessageTooLarge { len, max }) => assert_eq!((len, max), (MAX_MESSAGE as u64 + 1, MAX_MESSAGE)),
        other => panic!("{other:?}"),
    }
    assert!(buf.is_empty());
    assert!(matches!(server.recv(&mut buf, Some(PATIENCE)), Err(Error::PeerGone)), "the link was closed");
}

/// [`child_peer`] started in another process with [`CHILD_MODE_ENV`] `mode`, and its link, once
/// its hello (which names its pid) has come.
fn child_connected(mode: &str) -> (std::process::Child, TcpLink) {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["child_peer", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, addr.to_string())
        .env(CHILD_MODE_ENV, mode)
        .env(SECRET_ENV, std::str::from_utf8(KEY).unwrap())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let link = listener.accept(Some(PATIENCE), &secret(KEY)).expect("the child authenticates");
    let mut buf = Vec::new();
    link.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert_eq!(buf, format!("hello from {}", child.id()).as_bytes());
    (child, link)
}

#[test]
fn a_peer_process_killed_mid_message_reads_as_peer_gone() {
    let (mut child, link) = child_connected("");
    let mut buf = Vec::new();
    // The child is now sending a 16 MiB message that the socket buffers cannot hold unread.
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    child.wait().unwrap();
    let outcome = loop {
        match link.recv(&mut buf, Some(PATIENCE)) {
            Ok(()) => assert_eq!(buf.len(), MAX_MESSAGE, "only whole messages are returned"),
            other => break other,
        }
    };
    assert!(matches!(outcome, Err(Error::PeerGone)), "{outcome:?}");
}

/// A process that dies with bytes unread in its socket (a sender with credits unread) resets the
/// connection, and its kernel throws away the send queue: bytes written but not yet acknowledged
/// never reach the peer. Bytes the peer's machine acknowledged stay readable there. So a child
/// that kills itself once `unacknowledged` says 0, with the parent's bytes unread, loses nothing
/// of its 16 MiB message; while the parent is not reading, bytes are unacknowledged.
#[test]
fn a_peer_killed_once_its_bytes_are_acknowledged_loses_none_of_them() {
    let (mut child, link) = child_connected("acknowledged");
    let mut buf = Vec::new();
    // Bytes the child never reads, so that its death resets the connection.
    link.send(b"credit").unwrap();
    // The child is sending 16 MiB, which waits unacknowledged while this side does not read.
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "the child waits while its bytes are unacknowledged");
    link.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert!(buf.len() == MAX_MESSAGE && buf.iter().all(|&b| b == 7), "the whole message arrived");
    assert!(matches!(link.recv(&mut buf, Some(PATIENCE)), Err(Error::PeerGone)));
    assert!(!child.wait().unwrap().success(), "the child killed itself");
}

/// What `unacknowledged` counts in one process: nothing on a quiet link; a message the peer has
/// not read, until it reads.
#[test]
fn unacknowledged_counts_what_the_peer_has_not_taken_in() {
    let (client, server) = pair();
    assert_eq!(client.unacknowledged(), 0);
    assert!(client.try_send(&vec![1u8; MAX_MESSAGE]).unwrap());
    std::thread::sleep(Duration::from_millis(100));
    assert!(client.unacknowledged() > 0, "16 MiB do not fit a peer's buffers unread");
    let mut buf = Vec::new();
    server.recv(&mut buf, Some(PATIENCE)).unwrap();
    let deadline = std::time::Instant::now() + PATIENCE;
    while client.unacknowledged() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(client.unacknowledged(), 0, "read, and so acknowledged");
}

/// The other process of the tests above; does nothing unless started by them. With
/// [`CHILD_MODE_ENV`] `acknowledged` it kills itself once its message is acknowledged, never
/// reading what the parent sent; else it sleeps, to be killed mid-message.
#[test]
fn child_peer() {
    let Ok(addr) = std::env::var(CHILD_ENV) else { return };
    let secret = Secret::from_env().expect("the parent set TQ_SECRET");
    let link = TcpLink::connect(addr.as_str(), &secret, PATIENCE).unwrap();
    link.set_send_timeout(None);
    link.send(format!("hello from {}", std::process::id()).as_bytes()).unwrap();
    if std::env::var(CHILD_MODE_ENV).as_deref() == Ok("acknowledged") {
        std::thread::sleep(Duration::from_millis(100)); // the parent's bytes come, unread
        assert!(link.try_send(&vec![7; MAX_MESSAGE]).unwrap());
        let deadline = std::time::Instant::now() + PATIENCE;
        while link.unacknowledged() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(100));
        }
        let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
    let _ = link.send(&vec![7; MAX_MESSAGE]);
    std::thread::sleep(PATIENCE);
}

/// A message the socket cannot take at once is taken whole and finished by the link: `try_send`
/// never blocks, says `false` (nothing sent) while the rest is still going out, and the peer gets
/// every message whole and in order once it reads. Without the flusher the rest would wait for
/// the next send, forever for the last message.
#[test]
fn try_send_takes_a_message_whole_and_finishes_it_without_blocking() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let client = TcpLink::connect(addr, &secret(KEY), PATIENCE).unwrap();
    let server = accepted.recv_timeout(PATIENCE).unwrap().0.unwrap();
    let big: Vec<u8> = (0..MAX_MESSAGE).map(|i| (i % 251) as u8).collect();
    let started = std::time::Instant::now();
    assert!(client.try_send(&big).unwrap(), "a message is taken when the socket has room to start it");
    // 16 MiB does not fit the socket buffers of a peer that is not reading: the rest is pending.
    let refused = (0..100).filter(|_| !client.try_send(b"next").unwrap()).count();
    assert!(refused > 0, "while the first message is still going out, later ones are refused, not interleaved");
    assert!(started.elapsed() < Duration::from_secs(5), "try_send never waits for the peer");
    let mut buf = Vec::new();
    server.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert!(buf == big, "the first message arrived whole");
    // What was taken after the refusals arrives too, in order, with no one sending again.
    for _ in 0..(100 - refused) {
        server.recv(&mut buf, Some(PATIENCE)).unwrap();
        assert_eq!(buf, b"next");
    }
}

/// A sender refused while the flusher finishes an earlier message can wait for exactly that
/// (`wait_sent`), instead of polling a socket that has room all along; with nothing pending it
/// returns false at once.
#[test]
fn wait_sent_waits_for_the_flusher_and_then_the_link_takes_more() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let client = TcpLink::connect(addr, &secret(KEY), PATIENCE).unwrap();
    let server = accepted.recv_timeout(PATIENCE).unwrap().0.unwrap();
    assert!(!client.wait_sent(PATIENCE), "nothing is pending: no wait");
    let big = vec![3u8; MAX_MESSAGE];
    assert!(client.try_send(&big).unwrap());
    assert!(!client.try_send(b"next").unwrap(), "16 MiB to a peer that is not reading leaves some pending");
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        server.recv(&mut buf, Some(PATIENCE)).unwrap();
        assert!(buf == big, "the first message arrived whole");
        server.recv(&mut buf, Some(PATIENCE)).unwrap();
        buf
    });
    assert!(client.wait_sent(PATIENCE), "a message was pending: wait_sent waited for it");
    assert!(client.try_send(b"next").unwrap(), "once it is out, the link takes the next message");
    assert_eq!(reader.join().unwrap(), b"next");
}

/// A connected pair of links.
fn pair() -> (TcpLink, TcpLink) {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let accepted = accept_in_background(listener, KEY);
    let client = TcpLink::connect(addr, &secret(KEY), PATIENCE).unwrap();
    let server = accepted.recv_timeout(PATIENCE).unwrap().0.unwrap();
    (client, server)
}

/// Reads the bulk run next on `link` (whose length the record read that found it reported) into
/// a buffer, `step` bytes at most per read.
fn read_run(link: &TcpLink, step: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    let left = match link.recv(&mut buf, Some(PATIENCE)) {
        Err(Error::BulkAhead { left }) => left as usize,
        other => panic!("a run was next, yet {other:?}"),
    };
    assert_eq!(link.bulk_left(), Some(left as u64));
    let mut run = vec![0u8; left];
    let mut got = 0;
    let deadline = std::time::Instant::now() + PATIENCE;
    // At least one read: that of an empty run ends it.
    while got < left || link.bulk_left().is_some() {
        let n = link.try_recv_bulk(&mut run[got..(got + step).min(left)]).unwrap();
        got += n;
        if n == 0 && got < left {
            assert!(std::time::Instant::now() < deadline, "the run stopped at {got} of {left} bytes");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!(link.bulk_left(), None, "the run is over");
    run
}

/// Pieces of every kind (mapped memory, owned bytes, zeros, empty ones), more of them than one
/// vectored write takes, and more bytes than the sockets buffer: the run arrives whole and in
/// order between two messages, its pieces are held until written and dropped after, and the
/// sender never waited for the reader.
#[test]
fn a_bulk_run_of_many_pieces_arrives_whole_between_messages() {
    use ipc_core::tcp::{Bulk, Piece};
    use std::sync::Arc;
    let (client, server) = pair();
    let memory = ipc_core::SharedMemory::create("bulk-test", 8 << 20).unwrap();
    let pattern: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 253) as u8).collect();
    memory.write(0, &pattern).unwrap();
    let memory: Arc<dyn ipc_core::tcp::SharedBytes> = Arc::new(memory);
    let mut pieces = Vec::new();
    let mut expected = Vec::new();
    for i in 0..3000usize {
        let (offset, len) = ((i * 2731) % (7 << 20), (i * 37) % 5000);
        pieces.push(Piece::Shared { memory: memory.clone(), offset, len });
        expected.extend_from_slice(&pattern[offset..offset + len]);
        match i % 3 {
            0 => {
                pieces.push(Piece::Owned(vec![i as u8; i % 7]));
                expected.extend(std::iter::repeat_n(i as u8, i % 7));
            }
            1 => {
                pieces.push(Piece::Zeros(i % 16));
                expected.extend(std::iter::repeat_n(0, i % 16));
            }
            _ => pieces.push(Piece::Owned(Vec::new())),
        }
    }
    let held = Arc::new(());
    let run = Bulk::new(pieces, Box::new(held.clone())).unwrap();
    assert_eq!(run.len(), expected.len() as u64);
    assert!(client.try_send(b"before").unwrap());
    let started = std::time::Instant::now();
    assert!(client.try_send_bulk(run).unwrap().is_ok(), "taken: the socket had room to start it");
    assert!(!client.try_send(b"after").unwrap(), "refused while the run is still going out");
    assert!(started.elapsed() < Duration::from_secs(5), "try_send_bulk never waits for the peer");
    assert!(Arc::strong_count(&held) > 1, "the run holds its memory until written");
    let mut buf = Vec::new();
    server.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert_eq!(buf, b"before");
    let got = read_run(&server, 1 << 20);
    assert!(got == expected, "the run arrived altered ({} bytes, expected {})", got.len(), expected.len());
    client.wait_sent(PATIENCE);
    assert_eq!(Arc::strong_count(&held), 1, "written: the run let its memory go");
    client.send(b"after").unwrap();
    server.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert_eq!(buf, b"after");
}

/// Messages that follow a run in its write (`Bulk::followed_by`) arrive after the run's bytes,
/// whole and in order, whether the write took everything at once (a small run: one segment) or
/// the flusher finished it (a run larger than the socket's buffers); an oversize one is refused
/// before anything goes.
#[test]
fn messages_that_follow_a_run_in_its_write_arrive_after_it() {
    use ipc_core::tcp::{Bulk, MAX_MESSAGE, Piece};
    let (client, server) = pair();
    for run_len in [4096usize, 24 << 20] {
        let bytes: Vec<u8> = (0..run_len).map(|i| (i % 251) as u8).collect();
        let run = Bulk::new(vec![Piece::Owned(bytes.clone())], Box::new(()))
            .unwrap()
            .followed_by(b"the frame of the run")
            .unwrap()
            .followed_by(&[7u8; 70_000])
            .unwrap();
        assert_eq!(run.len(), run_len as u64, "the run's length leaves out what follows it");
        assert!(client.try_send_bulk(run).unwrap().is_ok());
        let got = read_run(&server, 1 << 20);
        assert!(got == bytes, "the run arrived altered");
        let mut buf = Vec::new();
        server.recv(&mut buf, Some(PATIENCE)).unwrap();
        assert_eq!(buf, b"the frame of the run");
        server.recv(&mut buf, Some(PATIENCE)).unwrap();
        assert_eq!(buf, vec![7u8; 70_000]);
        client.wait_sent(PATIENCE);
    }
    let too_large = vec![0u8; MAX_MESSAGE + 1];
    let refused = Bulk::new(Vec::new(), Box::new(())).unwrap().followed_by(&too_large);
    assert!(matches!(refused, Err(Error::MessageTooLarge { .. })));
    assert_eq!(carried(&client, &server, b"next"), b"next", "nothing of the refused run went");
}

/// A handshake the listener sheds before it started (a burst of connectors): the connector sees
/// a hang-up in the greeting, before any secret was used, tries again, and gets in.
#[test]
fn a_connector_whose_handshake_is_shed_tries_again_and_gets_in() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let connector = std::thread::spawn(move || TcpLink::connect(addr, &secret(KEY), PATIENCE));
    let first = listener.accept_unverified(Some(PATIENCE)).unwrap();
    assert!(first.abort_handle().unwrap().abort(), "shed while under way");
    let shed = first.verify(&secret(KEY)).map(|_| ());
    assert!(matches!(shed, Err(Error::HandshakeShed { .. })), "{shed:?}");
    let ours = listener.accept_unverified(Some(PATIENCE)).unwrap().verify(&secret(KEY)).unwrap();
    let theirs = connector.join().unwrap().unwrap();
    assert_eq!(carried(&theirs, &ours, b"in"), b"in");
}

/// A raw connector to `listener` that greeted and read the listener's greeting, then stopped
/// (the listener waits for its answer, verifying on a thread): the socket, the handshake's abort
/// handle, and the verifying thread.
fn greeted(listener: &TcpListener) -> (TcpStream, HandshakeAbort, std::thread::JoinHandle<Result<(), Error>>) {
    let mut raw = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    raw.set_read_timeout(Some(PATIENCE)).unwrap();
    let first = listener.accept_unverified(Some(PATIENCE)).unwrap();
    let abort = first.abort_handle().unwrap();
    let verifying = std::thread::spawn(move || first.verify(&secret(KEY)).map(|_| ()));
    raw.write_all(&[&b"tq-auth-v1C"[..], &[0x5a; 32]].concat()).unwrap();
    let mut hello = [0u8; 43];
    raw.read_exact(&mut hello).unwrap();
    (raw, abort, verifying)
}

/// A handshake shed after the greetings (the connector's answer on its way) is told so in place
/// of the listener's answer: 32 bytes no HMAC answer is, `tq-auth-v1 shed: try again later`
/// (what makes `TcpLink::connect` try again with `HandshakeShed`, not `AuthFailed`).
#[test]
fn a_handshake_shed_after_the_greetings_is_told_so_in_place_of_the_answer() {
    let listener = listener();
    let (mut raw, abort, verifying) = greeted(&listener);
    assert!(abort.heard_from(), "our greeting was read");
    assert!(abort.abort(), "shed while it waits for our answer");
    let mut told = [0u8; 32];
    raw.read_exact(&mut told).unwrap();
    assert_eq!(&told, b"tq-auth-v1 shed: try again later");
    let shed = verifying.join().unwrap();
    assert!(matches!(shed, Err(Error::HandshakeShed { .. })), "{shed:?}");
}

/// `heard_from` never says "nothing heard" while the listener takes in the greeting: a
/// greeting's bytes either wait in the socket or were marked heard before they were read. (A
/// listener that marked them after reading left a window where a shed took the wrong
/// handshake; seen once in 2 x H200 runs.) Many handshakes, each asked at the moment the
/// listener reads the greeting.
#[test]
fn heard_from_has_no_window_while_the_greeting_is_read() {
    let listener = listener();
    for round in 0..400 {
        let (raw, abort, verifying) = greeted(&listener);
        assert!(abort.heard_from(), "round {round}: our greeting was sent before we read the listener's");
        drop(raw);
        assert!(verifying.join().unwrap().is_err(), "round {round}: no answer was sent");
    }
}

/// A wrong secret is not tried again: the listener's hang-up after the connector's answer is
/// what a wrong secret looks like, and the listener sees one refusal.
#[test]
fn a_wrong_secret_is_refused_after_one_attempt() {
    let listener = listener();
    let addr = listener.local_addr().unwrap();
    let connector =
        std::thread::spawn(move || TcpLink::connect(addr, &secret(b"a-different-secret-entirely-0000"), PATIENCE));
    let refused = listener.accept(Some(PATIENCE), &secret(KEY));
    assert!(matches!(refused, Err(Error::AuthFailed { .. })), "{refused:?}");
    assert!(matches!(connector.join().unwrap(), Err(Error::AuthFailed { .. })));
    let again = listener.accept(Some(Duration::from_millis(300)), &secret(KEY));
    assert!(matches!(&again, Err(Error::Os { .. })), "no second attempt came: {again:?}");
}

/// An empty run is a header alone; a run of a piece outside its memory is refused before a byte
/// goes; a link that only reads messages reports a run as `BulkAhead` instead of waiting.
#[test]
fn empty_and_bad_runs() {
    use ipc_core::tcp::{Bulk, MAX_ZEROS, Piece};
    let (client, server) = pair();
    assert!(client.try_send_bulk(Bulk::new(Vec::new(), Box::new(())).unwrap()).unwrap().is_ok());
    client.send(b"next").unwrap();
    assert!(read_run(&server, 16).is_empty());
    let mut buf = Vec::new();
    server.recv(&mut buf, Some(PATIENCE)).unwrap();
    assert_eq!(buf, b"next");
    let memory: std::sync::Arc<dyn ipc_core::tcp::SharedBytes> =
        std::sync::Arc::new(ipc_core::SharedMemory::create("bulk-test", 4096).unwrap());
    let outside = Piece::Shared { memory, offset: 4000, len: 97 };
    assert!(matches!(Bulk::new(vec![outside], Box::new(())), Err(Error::InvalidArgument(_))));
    assert!(matches!(Bulk::new(vec![Piece::Zeros(MAX_ZEROS + 1)], Box::new(())), Err(Error::InvalidArgument(_))));
    assert!(matches!(server.try_recv_bulk(&mut [0u8; 4]), Err(Error::InvalidArgument(_))), "no run is next");
}

/// A sender that dies in the middle of a run: the reader gets `PeerGone`, not a hang or a
/// short run taken for whole.
#[test]
fn a_peer_gone_in_the_middle_of_a_run_reads_as_peer_gone() {
    use ipc_core::tcp::{Bulk, Piece};
    let (client, server) = pair();
    let run = Bulk::new(vec![Piece::Owned(vec![9u8; 32 << 20])], Box::new(())).unwrap();
    assert!(client.try_send_bulk(run).unwrap().is_ok());
    let mut buf = Vec::new();
    let left = match server.recv(&mut buf, Some(PATIENCE)) {
        Err(Error::BulkAhead { left }) => left as usize,
        other => panic!("a run was next, yet {other:?}"),
    };
    let mut run = vec![0u8; left];
    let got = loop {
        match server.try_recv_bulk(&mut run[..1 << 20]) {
            Ok(n) if n > 0 => break n,
            Ok(_) => std::thread::sleep(Duration::from_millis(1)),
            Err(error) => panic!("{error:?}"),
        }
    };
    assert!(got > 0);
    client.shutdown();
    drop(client);
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        match server.try_recv_bulk(&mut run) {
            Err(Error::PeerGone) => break,
            Ok(n) => assert!(n < left, "the run cannot be whole"),
            Err(other) => panic!("{other:?}"),
        }
        assert!(std::time::Instant::now() < deadline, "no PeerGone");
        std::thread::sleep(Duration::from_millis(1));
    }
}
