//! Careless and hostile peers for the attack tests (`tests/tests/queue_host.rs`,
//! `tests/tests/tcp_host.rs`): each role is a second process doing one thing a user or an
//! attacker may do, written against the public API or the wire as an outsider would.
//! `tq-hostile <role> [args]`:
//!
//! - `wrong-type PATH`: a `Sender<(String, Tensor)>` to a receiver that expects another type; sends one
//!   message, waits until it is released, and says `rejected SEQ REASON` for each refusal it
//!   heard of (`take_rejected`), then `done`;
//! - `senders PATH N COUNT`: `N` `Sender<u64>`s of this one process each send `COUNT` messages
//!   (`1000 * k + i`), then say `done`;
//! - `silent-tcp ADDR N`: opens `N` TCP connections to `ADDR` and says nothing on them; says
//!   `ready`, and holds them until stdin closes;
//! - `claim-tcp ADDR N`: opens `N` connections, each authenticated with `TQ_SECRET`, and on each
//!   writes a record header claiming the largest record followed by one byte; says `ready`, and
//!   holds them until stdin closes;
//! - `parts-tcp ADDR MIB`: one authenticated connection that says hello and then writes `MIB` MiB
//!   of frame parts that never end; says `ready`, and holds it until stdin closes;
//! - `mid-message-tcp ADDR`: says hello and the first part of a two-part message, says `ready`,
//!   and waits to be killed.
//! - `half-record-tcp ADDR`: says hello and half of the one record of a small message (its length
//!   header and the first half of its bytes), says `ready`, and waits to be killed.
//!
//! - `attack-received PATH`: binds a `Receiver<Tensor>` at `PATH`, says `listening`, receives
//!   one host tensor, then attacks every shared-memory file it holds as a receiver would to write
//!   the sender's memory (make the file writable by its mode, reopen it through `/proc/self/fd`
//!   for writing, map it shared read-write, `write`, punch a hole, `mprotect` a read-only
//!   mapping): says `wrote HOW` for each way that wrote, `refused HOW` otherwise, then `done`.
//!
//! - `exchange BIND CONNECT`: binds a `Receiver<Vec<u8>>` at `BIND` and says `listening`, then
//!   connects a `Sender<Vec<u8>>` to `CONNECT`, sends 8 MiB of plain data before receiving,
//!   receives one message, says `received LEN`, then `done` (not a hostile peer: the other half
//!   of a pair that each send first).
//!
//! - `fd-starved PATH`: binds a `Receiver<Tensor>` at `PATH`, says `listening`, receives one
//!   message (`got BYTES`), then uses up its descriptor table and says `starved`; receives the
//!   next message (`got BYTES`, or `rejected REASON`), frees its table and says `recovered`;
//!   then receives until every sender has gone (`got BYTES` or `rejected REASON` each), and
//!   says `done`.
//!
//! - `deep-value PATH DEPTH`: a sender whose one message's payload is the Python package's value
//!   tree (`tensor-queue/python/src/value.rs`) nested `DEPTH` lists deep, written byte by byte
//!   (no encoder of ours would make it); waits until it is released, says `rejected SEQ REASON`
//!   for each refusal, then `done`.
//! - `odd-values PATH`: a sender of four Python value trees written byte by byte: an `int` whose
//!   text is no number, a dict whose key is a list, an `int` in decimal (as older senders wrote
//!   them), and the int 5; waits until they are released, says `rejected SEQ REASON` for each
//!   refusal, then `done`.
//!
//! Any error: `error DEBUG` on stdout and exit status 1.

use std::io::{BufRead as _, Write as _};
use std::net::TcpStream;
use std::os::fd::AsFd as _;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use integration_tests::program::{join_senders, say};
use ipc_core::tcp::{Secret, TcpLink};
use tensor_queue::testing::wire::{Frame, Hello, MAX_PACKET, ToReceiver, packets};
use tensor_queue::{DEFAULT_CAPACITY, DType, Sender, Tensor};

fn main() {
    if let Err(error) = run() {
        say(&format!("error {error:?}"));
        std::process::exit(1);
    }
}

/// Waits until stdin closes (the test's way of ending a role).
fn until_stdin_closes() {
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().with_context(|| format!("argument {i} missing: {args:?}"));
    let number = |i: usize| -> Result<u64> { Ok(arg(i)?.parse()?) };
    match arg(0)?.as_str() {
        "wrong-type" => wrong_type(&arg(1)?),
        "senders" => senders(&arg(1)?, number(2)?, number(3)?),
        "silent-tcp" => {
            let addr = arg(1)?.trim_start_matches("tcp://").to_string();
            let held: Vec<TcpStream> = (0..number(2)?).map(|_| TcpStream::connect(&addr)).collect::<Result<_, _>>()?;
            say("ready");
            until_stdin_closes();
            drop(held);
            Ok(())
        }
        "claim-tcp" => {
            let mut held = Vec::new();
            for _ in 0..number(2)? {
                let link = authenticated(&arg(1)?)?;
                let mut raw = std::fs::File::from(link.as_fd().try_clone_to_owned()?);
                raw.write_all(&[&(ipc_core::tcp::MAX_MESSAGE as u32).to_le_bytes()[..], &[7u8]].concat())?;
                held.push(link);
            }
            say("ready");
            until_stdin_closes();
            Ok(())
        }
        "parts-tcp" => {
            let link = authenticated(&arg(1)?)?;
            link.send(&hello())?;
            // One frame larger than everything that follows: its parts never end.
            let whole = ToReceiver::Bytes { data: vec![5u8; ((number(2)? + 1) << 20) as usize] }.encode();
            let parts = packets(&whole);
            let mut sent = 0u64;
            for part in &parts[..parts.len() - 1] {
                if sent >= number(2)? << 20 {
                    break;
                }
                link.send(part)?;
                sent += part.len() as u64;
            }
            say("ready");
            until_stdin_closes();
            Ok(())
        }
        "mid-message-tcp" => {
            let link = authenticated(&arg(1)?)?;
            link.send(&hello())?;
            let whole = ToReceiver::Bytes { data: vec![5u8; 2 * MAX_PACKET] }.encode();
            link.send(&packets(&whole)[0])?;
            say("ready");
            until_stdin_closes();
            Ok(())
        }
        "half-record-tcp" => {
            let link = authenticated(&arg(1)?)?;
            link.send(&hello())?;
            let whole = ToReceiver::Bytes { data: vec![5u8; 1000] }.encode();
            let mut raw = std::fs::File::from(link.as_fd().try_clone_to_owned()?);
            raw.write_all(&[&(whole.len() as u32).to_le_bytes()[..], &whole[..whole.len() / 2]].concat())?;
            say("ready");
            until_stdin_closes();
            Ok(())
        }
        "attack-received" => attack_received(&arg(1)?),
        "fd-starved" => fd_starved(&arg(1)?),
        "deep-value" => deep_value(&arg(1)?, number(2)? as usize),
        "odd-values" => odd_values(&arg(1)?),
        "exchange" => {
            let mut receiver = tensor_queue::Receiver::<Vec<u8>>::bind(arg(1)?)?;
            say("listening");
            let sender = Sender::<Vec<u8>>::connect(arg(2)?)?;
            sender.send(&vec![3u8; 8 << 20])?;
            let got = receiver.recv()?;
            say(&format!("received {}", got.len()));
            drop(sender);
            say("done");
            Ok(())
        }
        other => bail!("unknown role {other}"),
    }
}

/// Bytes that postcard writes as they are (a tuple of `u8`s has no length prefix): a payload
/// made by hand.
struct RawPayload(Vec<u8>);

impl serde::Serialize for RawPayload {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple as _;
        let mut tuple = serializer.serialize_tuple(self.0.len())?;
        for byte in &self.0 {
            tuple.serialize_element(byte)?;
        }
        tuple.end()
    }
}

/// A Python value tree `depth` lists deep: `List` is variant 7 of `Value`, each holding one item,
/// and `None` (variant 0) at the bottom.
fn deep_value(path: &str, depth: usize) -> Result<()> {
    let sender = Sender::<RawPayload>::connect(path)?;
    let mut bytes = [7u8, 1].repeat(depth);
    bytes.push(0);
    sender.send(&RawPayload(bytes))?;
    report_rejections(&sender)
}

/// Python value trees Python cannot make (an `int` text that is no number: `BigInt` is variant 3
/// of `Value`; a dict, variant 9, whose one key is an empty list, variant 7), then ones it can
/// (an `int` in decimal, and `Int`, variant 2, of 5: zigzag 10).
fn odd_values(path: &str) -> Result<()> {
    let sender = Sender::<RawPayload>::connect(path)?;
    for bytes in [&b"\x03\x0312x"[..], &[9, 1, 7, 0, 0], &b"\x03\x15-12345678901234567890"[..], &[2, 10]] {
        sender.send(&RawPayload(bytes.to_vec()))?;
    }
    report_rejections(&sender)
}

/// Waits for `sender`'s messages to be released (30 s at most), says `rejected SEQ REASON` for
/// each refused, then `done`.
fn report_rejections<T: serde::Serialize>(sender: &Sender<T>) -> Result<()> {
    if !sender.wait_released(Duration::from_secs(30)) {
        bail!("the message was not released within 30 s");
    }
    for rejection in sender.take_rejected() {
        say(&format!("rejected {} {}", rejection.seq, rejection.reason));
    }
    say("done");
    Ok(())
}

/// A sender whose type is not the receiver's.
fn wrong_type(path: &str) -> Result<()> {
    let sender = Sender::<(String, Tensor)>::connect(path)?;
    let tensor = Tensor::from_slice(&[1.0f32; 16], DType::F32, &[16])?;
    sender.send(&("not what the receiver expects".to_string(), tensor))?;
    report_rejections(&sender)
}

/// Several senders in one process.
fn senders(path: &str, count: u64, messages: u64) -> Result<()> {
    let threads: Vec<_> = (0..count)
        .map(|k| {
            let path = path.to_string();
            std::thread::spawn(move || -> Result<()> {
                let sender = Sender::<u64>::connect(&path)?;
                for i in 0..messages {
                    sender.send(&(1000 * k + i))?;
                }
                Ok(())
            })
        })
        .collect();
    join_senders(threads)?;
    say("done");
    Ok(())
}

/// A TCP connection past the handshake, with the secret in `TQ_SECRET`.
fn authenticated(addr: &str) -> Result<TcpLink> {
    let addr = addr.trim_start_matches("tcp://");
    Ok(TcpLink::connect(addr, &Secret::from_env()?, Duration::from_secs(30))?)
}

/// The sender's first frame, as a plain host sender sends it.
fn hello() -> Vec<u8> {
    Hello {
        pid: std::process::id(),
        host: [0; 16],
        capacity: DEFAULT_CAPACITY,
        instance: 1,
        reach: Default::default(),
        routing: Default::default(),
    }
    .encode()
}

/// A receiver that tries to write the memory it was given read-only.
fn attack_received(path: &str) -> Result<()> {
    use rustix::fs::{FallocateFlags, Mode, OFlags};
    use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};
    let mut receiver = tensor_queue::Receiver::<Tensor>::bind(path)?;
    say("listening");
    let tensor = receiver.recv()?;
    let mut attacked = 0;
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let entry = entry?;
        let Ok(target) = std::fs::read_link(entry.path()) else { continue };
        if !target.to_string_lossy().starts_with("/memfd:tensor-queue") {
            continue;
        }
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        // SAFETY: the descriptor is open in this process for the duration of the borrow (the
        // receiver keeps its chunk, and with it the descriptor, while `tensor` lives).
        let given = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        if rustix::fs::fcntl_getfl(given)? & OFlags::RWMODE != OFlags::RDONLY {
            continue; // a file shared writable on purpose (signal words)
        }
        attacked += 1;
        let _ = rustix::fs::fchmod(given, Mode::RUSR | Mode::WUSR); // its owner may
        let reopened = match rustix::fs::open(format!("/proc/self/fd/{fd}").as_str(), OFlags::RDWR, Mode::empty()) {
            Ok(reopened) => reopened,
            Err(error) => {
                say(&format!("refused reopen {error}"));
                continue;
            }
        };
        let len = rustix::fs::fstat(&reopened)?.st_size as usize;
        // SAFETY: a fresh mapping at an address the kernel picks; written below only if granted.
        match unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &reopened,
                0,
            )
        } {
            Ok(ptr) => {
                // SAFETY: the mapping is ours, `len` bytes, writable.
                unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0xEE, len) };
                say("wrote mmap");
            }
            Err(error) => say(&format!("refused mmap {error}")),
        }
        match rustix::io::pwrite(&reopened, &vec![0xEE; len], 0) {
            Ok(_) => say("wrote pwrite"),
            Err(error) => say(&format!("refused pwrite {error}")),
        }
        match rustix::fs::fallocate(&reopened, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, 0, len as u64) {
            Ok(()) => say("wrote fallocate"),
            Err(error) => say(&format!("refused fallocate {error}")),
        }
        // SAFETY: as above, read-only.
        let read_only =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ, MapFlags::SHARED, &reopened, 0) }?;
        // SAFETY: our own mapping; written only if the protection change was granted.
        match unsafe { rustix::mm::mprotect(read_only, len, MprotectFlags::READ | MprotectFlags::WRITE) } {
            Ok(()) => {
                // SAFETY: the mapping is now writable, `len` bytes.
                unsafe { std::ptr::write_bytes(read_only.cast::<u8>(), 0xEE, len) };
                say("wrote mprotect");
            }
            Err(error) => say(&format!("refused mprotect {error}")),
        }
    }
    if attacked == 0 {
        bail!("no read-only shared-memory file found to attack");
    }
    drop(tensor);
    say("done");
    Ok(())
}

/// A receiver that runs out of descriptors while a chunk's descriptor is on its way.
fn fd_starved(path: &str) -> Result<()> {
    let mut receiver = tensor_queue::Receiver::<Tensor>::bind(path)?;
    say("listening");
    let report = |received: tensor_queue::Result<Tensor>| match received {
        Ok(tensor) => say(&format!("got {}", tensor.nbytes())),
        Err(tensor_queue::Error::Rejected { reason, .. }) => say(&format!("rejected {reason}")),
        Err(other) => say(&format!("recv-error {other}")),
    };
    report(receiver.recv());
    let nofile = rustix::process::Resource::Nofile;
    let saved = rustix::process::getrlimit(nofile);
    let open = std::fs::read_dir("/proc/self/fd")?.count() as u64;
    rustix::process::setrlimit(nofile, rustix::process::Rlimit { current: Some(open + 8), maximum: saved.maximum })?;
    let mut fillers = Vec::new();
    while let Ok(file) = std::fs::File::open("/dev/null") {
        fillers.push(file);
    }
    say("starved");
    report(receiver.recv());
    drop(fillers);
    rustix::process::setrlimit(nofile, saved)?;
    say("recovered");
    loop {
        match receiver.recv() {
            Err(tensor_queue::Error::Disconnected) => break,
            received => report(received),
        }
    }
    say("done");
    Ok(())
}
