//! The second process of `tests/tests/outside_rust.rs`: an outside user's program that uses only
//! the public API of tensor-queue. Each mode is one role; it reports on stdout, one line a step.

use std::io::BufRead;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use integration_tests::program::{connect, pattern, say};
use tensor_queue::{DType, Error, Receiver, Tensor};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("");
    match mode {
        // Sends one pattern tensor, then waits for stdin to close.
        "hold" => {
            let sender = connect::<Tensor>(&args[1])?;
            let len: usize = args[2].parse()?;
            sender.send(&Tensor::new(&pattern(len, 7), &[len])?)?;
            say("sent");
            let _ = std::io::stdin().lock().lines().count();
        }
        // Sends `count` pattern tensors and SIGKILLs itself before the receiver can look.
        "send-and-die" => {
            let sender = connect::<Tensor>(&args[1])?;
            let count: u8 = args[2].parse()?;
            for n in 0..count {
                sender.send(&Tensor::new(&pattern(1 << 20, n), &[1 << 20])?)?;
            }
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL)?;
        }
        // Announces, then sends one big host tensor (the test kills it while the bytes go).
        "send-big" => {
            let sender = connect::<Tensor>(&args[1])?;
            let len: usize = args[2].parse()?;
            let big = Tensor::new(&pattern(len, 1), &[len])?;
            say("sending");
            sender.send(&big)?;
            say("sent");
            std::thread::sleep(Duration::from_secs(600));
        }
        // Binds `args[1]` (printing its TCP port if any), sends a big tensor to `args[2]` first,
        // then receives the other side's big tensor and checks it.
        "big-first" => {
            let len: usize = args[3].parse()?;
            let mut receiver = Receiver::<Tensor>::bind(args[1].as_str())?;
            match receiver.local_addr() {
                Some(addr) => say(&format!("port {}", addr.port())),
                None => say("bound"),
            }
            let target = std::io::stdin().lock().lines().next().context("no target")??;
            let target = if target.is_empty() { args[2].clone() } else { target };
            let sender = connect::<Tensor>(&target)?;
            sender.send(&Tensor::new(&pattern(len, 2), &[len])?)?;
            say("sent");
            let got = receiver.recv_timeout(Duration::from_secs(120))?;
            if got.to_vec::<u8>()? != pattern(len, 3) {
                bail!("wrong bytes");
            }
            say("received");
            drop(sender);
        }
        // A receiver with few descriptors left: holds every message it receives, then reports.
        "fd-starved" => {
            let spare: u64 = args[2].parse()?;
            let count: usize = args[3].parse()?;
            let mut receiver = Receiver::<Tensor>::builder().capacity(64).bind(args[1].as_str())?;
            say("bound");
            let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
            let mut held = Vec::new();
            let mut rejected = 0;
            let mut other = Vec::new();
            for n in 0..count {
                match receiver.recv_timeout(Duration::from_secs(60)) {
                    Ok(t) => held.push(t),
                    Err(Error::Rejected { reason, .. }) => {
                        rejected += 1;
                        say(&format!("rejected {reason}"));
                    }
                    Err(e) => {
                        other.push(e.to_string());
                        break;
                    }
                }
                if n == 0 {
                    // The spare descriptors are counted once the connection is up and its first
                    // message held: what the process opens for a connection (on the GPU machine
                    // the driver's own descriptors, its contexts' among them) is not the peer's
                    // to take, and would otherwise leave none spare (every message refused).
                    let open = std::fs::read_dir("/proc/self/fd")?.count() as u64;
                    rustix::process::setrlimit(
                        rustix::process::Resource::Nofile,
                        rustix::process::Rlimit { current: Some(open + spare), maximum: limit.maximum },
                    )?;
                }
            }
            for (n, t) in held.iter().enumerate() {
                let _ = (n, t.dtype() == DType::U8);
            }
            let summary = format!("held {} rejected {} other {:?}", held.len(), rejected, other);
            // Then do what the refusal said: raise the limit again. (Letting go of the held
            // tensors alone frees no descriptor: a mapped chunk keeps its own until its sender
            // retires it, so a chunk announced again could still not be mapped.) The test sends
            // its next message once it reads the summary.
            drop(held);
            rustix::process::setrlimit(rustix::process::Resource::Nofile, limit)?;
            say(&summary);
            // After letting go, the channel goes on.
            match receiver.recv_timeout(Duration::from_secs(60)) {
                Ok(t) => say(&format!("after {}", t.shape()[0])),
                Err(e) => say(&format!("after-error {e}")),
            }
        }
        // A receiver of a recursive message type: reports each of `args[2]` messages' depth,
        // or why it was refused.
        "tree" => {
            let mut receiver = Receiver::<Tree>::bind(args[1].as_str())?;
            say("bound");
            for _ in 0..args[2].parse::<usize>()? {
                match receiver.recv_timeout(Duration::from_secs(60)) {
                    Ok(tree) => say(&format!("depth {}", tree.depth())),
                    Err(e) => say(&format!("refused {e}")),
                }
            }
        }
        // A receiver that attacks the read-only host memory it was sent with its own system
        // calls (as root here): each attempt's outcome, then whether the tensor is intact.
        "attack-ro" => {
            let mut receiver = Receiver::<Tensor>::bind(args[1].as_str())?;
            let len: usize = args[2].parse()?;
            say("bound");
            let tensor = receiver.recv_timeout(Duration::from_secs(60))?;
            for entry in std::fs::read_dir("/proc/self/fd")? {
                let entry = entry?;
                let Ok(link) = std::fs::read_link(entry.path()) else { continue };
                // The link's own control rings (writable by both ends by design; they carry frames,
                // never a tensor's bytes) are not the sender's memory.
                let link = link.to_string_lossy();
                if !link.starts_with("/memfd:") || link.starts_with("/memfd:tensor-queue ring") {
                    continue;
                }
                attack(&entry.path());
            }
            let now = tensor.to_vec::<u8>()?;
            say(if now == pattern(len, 5) { "intact" } else { "changed" });
        }
        other => bail!("unknown mode {other:?}"),
    }
    Ok(())
}

/// A recursive message type, as users write them.
#[derive(serde::Deserialize)]
enum Tree {
    Leaf(#[allow(dead_code)] u32),
    Node(Vec<Tree>),
}

impl Tree {
    /// How many nodes down its deepest leaf lies.
    fn depth(&self) -> usize {
        match self {
            Tree::Leaf(_) => 0,
            Tree::Node(children) => 1 + children.iter().map(Tree::depth).max().unwrap_or(0),
        }
    }
}

/// Tries every way this process has to write the memfd at `path` (a `/proc/self/fd` entry),
/// printing `<attempt> ok` or `<attempt> refused <errno>` for each.
fn attack(path: &std::path::Path) {
    use rustix::fs::{FallocateFlags, Mode, OFlags};
    use rustix::mm::{MapFlags, ProtFlags};
    let report = |what: &str, r: std::result::Result<(), rustix::io::Errno>| match r {
        Ok(()) => say(&format!("{what} ok")),
        Err(e) => say(&format!("{what} refused {e}")),
    };
    let Ok(ro) = rustix::fs::open(path, OFlags::RDONLY, Mode::empty()) else { return };
    report("fchmod", rustix::fs::fchmod(&ro, Mode::from_raw_mode(0o666)));
    let rw = match rustix::fs::open(path, OFlags::RDWR, Mode::empty()) {
        Ok(fd) => fd,
        Err(e) => return say(&format!("open-rdwr refused {e}")),
    };
    let len = rustix::fs::fstat(&rw).map(|s| s.st_size as usize).unwrap_or(0);
    if len == 0 {
        return;
    }
    // SAFETY: a fresh mapping of `len` bytes of a file we hold; no Rust reference aliases it,
    // and it is unmapped below before anything else could use it.
    let mapped = unsafe {
        rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &rw, 0)
    };
    match mapped {
        Ok(ptr) => {
            // SAFETY: `ptr` maps `len` writable bytes (the mapping just succeeded).
            unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0xAA, len) };
            say("mmap-shared-write ok");
            // SAFETY: the mapping made above, not used after this.
            let _ = unsafe { rustix::mm::munmap(ptr, len) };
        }
        Err(e) => say(&format!("mmap-shared-write refused {e}")),
    }
    report("pwrite", rustix::io::pwrite(&rw, &[0xBB; 4096], 0).map(|_| ()));
    report(
        "fallocate-punch",
        rustix::fs::fallocate(&rw, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, 0, len as u64),
    );
    report("ftruncate-shrink", rustix::fs::ftruncate(&rw, 0));
}
