//! The second process of `tests/tests/outside_round4.rs`: an outside user's program that uses only
//! the public API of tensor-queue. Each mode is one role; it reports on stdout, one line a step.
//! TCP modes read the secret from `TQ_SECRET`, as the README says a user's program does.

use std::io::BufRead;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use integration_tests::program::{connect, pattern, say};
use tensor_queue::{Receiver, Sender, Tensor};

/// Lowers this process's soft RLIMIT_NOFILE to `limit` (the hard limit stays).
fn lower_fd_limit(limit: u64) -> Result<()> {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    let lowered = rustix::process::Rlimit { current: Some(limit), maximum: hard };
    Ok(rustix::process::setrlimit(rustix::process::Resource::Nofile, lowered)?)
}

fn kill_myself() -> Result<()> {
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL)?;
    bail!("still alive after SIGKILL")
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("");
    match mode {
        // Sends `count` pattern tensors of `len` bytes (numbered from 0), says "sent N" after each
        // send returned, then "done" and waits for stdin to close (the test may kill it anywhere).
        "send" => {
            let sender = connect::<Tensor>(&args[1])?;
            let len: usize = args[2].parse()?;
            let count: u8 = args[3].parse()?;
            for n in 0..count {
                sender.send(&Tensor::new(&pattern(len, n), &[len])?)?;
                say(&format!("sent {n}"));
            }
            say("done");
            let _ = std::io::stdin().lock().lines().count();
        }
        // Sends one pattern tensor of `len` bytes and SIGKILLs itself the moment send returns.
        "send-then-die" => {
            let sender = connect::<Tensor>(&args[1])?;
            let len: usize = args[2].parse()?;
            sender.send(&Tensor::new(&pattern(len, 5), &[len])?)?;
            kill_myself()?;
        }
        // Binds a TCP receiver on a free port, says "port P", receives `count` messages and says
        // "got N LEN" for each (the test kills it mid-transfer).
        "recv" => {
            let mut receiver = Receiver::<Tensor>::bind("tcp://127.0.0.1:0")?;
            say(&format!("port {}", receiver.local_addr().context("no address")?.port()));
            let count: usize = args[1].parse()?;
            for n in 0..count {
                let t = receiver.recv()?;
                say(&format!("got {n} {}", t.nbytes()));
            }
        }
        // Lowers RLIMIT_NOFILE to `limit`, then connects senders to `endpoint` until one fails:
        // says "connected N" and "error DEBUG" for the failure, then sends one message on each
        // sender it holds and says "sent N". Exits 0 when the failure was a typed error.
        "fd-limit" => {
            let limit: u64 = args[2].parse()?;
            lower_fd_limit(limit)?;
            let mut senders = Vec::new();
            let mut failure = None;
            for _ in 0..limit * 2 {
                match Sender::<u64>::connect(&args[1]) {
                    Ok(sender) => senders.push(sender),
                    Err(error) => {
                        failure = Some(error);
                        break;
                    }
                }
            }
            say(&format!("connected {}", senders.len()));
            match failure {
                Some(error) => say(&format!("error {error:?}")),
                None => say("error none"),
            }
            // Give one descriptor room back by dropping the last sender, then use the rest.
            senders.pop();
            let mut sent = 0;
            for (n, sender) in senders.iter().enumerate() {
                sender.send_timeout(&(n as u64), Duration::from_secs(30))?;
                sent += 1;
            }
            say(&format!("sent {sent}"));
            drop(senders);
        }
        // Sends a broadcast view of one element with `numel` elements (a huge logical size) and
        // reports what send said; exits 0 whatever it said, unless the process dies.
        "send-expanded" => {
            let sender = connect::<Tensor>(&args[1])?;
            let numel: u64 = args[2].parse()?;
            let one = Tensor::new(&[7u8], &[1])?;
            let view = one.expand(&[numel])?;
            match sender.send_timeout(&view, Duration::from_secs(60)) {
                Ok(()) => say("send ok"),
                Err(error) => say(&format!("send error {error:?}")),
            }
            if !sender.wait_written(Duration::from_secs(60)) {
                say("not written");
            }
            say("done");
            let _ = std::io::stdin().lock().lines().count();
        }
        // Receives one tensor and reports its shape, strides and first element, or the error.
        "recv-one" => {
            let mut receiver = Receiver::<Tensor>::bind(args[1].as_str())?;
            say(&format!("bound {}", receiver.local_addr().map(|a| a.port()).unwrap_or(0)));
            match receiver.recv_timeout(Duration::from_secs(60)) {
                Ok(t) => {
                    let first = if t.numel() > 0 { t.get::<u8>(&vec![0; t.shape().len()])? } else { 0 };
                    say(&format!("got {:?} {:?} {first}", t.shape(), t.strides()));
                }
                Err(error) => say(&format!("recv error {error:?}")),
            }
            say(&format!("errors {:?}", receiver.take_errors()));
        }
        // Lowers RLIMIT_NOFILE to `limit`, binds `endpoint` and says "bound PORT" (0 for a
        // socket path), then says "got N" for each u64 until every sender has gone (or 30 s pass
        // without a message), then "errors N" (how many take_errors reported).
        // Binds `endpoint` with only `headroom` descriptors free above those the process holds
        // once bound (the CUDA driver's own, where there is a GPU, counted: it opens them when
        // the receiver first describes this machine's GPUs, which the first greeting does).
        "recv-limited" => {
            let headroom: u64 = args[2].parse()?;
            let _ = tensor_queue::Device::count(); // the driver's descriptors, where there is one
            let mut receiver = Receiver::<u64>::bind(args[1].as_str())?;
            // Counted, not the highest number: new descriptors take the lowest free numbers, and
            // a stray one inherited high up (a build tool's) would lift the limit past use.
            let open = std::fs::read_dir("/proc/self/fd")?.count() as u64;
            lower_fd_limit(open + headroom)?;
            say(&format!("bound {}", receiver.local_addr().map(|a| a.port()).unwrap_or(0)));
            loop {
                match receiver.recv_timeout(Duration::from_secs(30)) {
                    Ok(n) => say(&format!("got {n}")),
                    Err(tensor_queue::Error::Disconnected | tensor_queue::Error::Timeout) => break,
                    Err(e) => say(&format!("recv error {e:?}")),
                }
            }
            say(&format!("errors {}", receiver.take_errors().len()));
        }
        // Reads a broadcast view of one byte with `numel` elements with `to_vec` and `to_bytes`
        // under a 16 GiB address-space limit (so no machine fills its memory), reporting each.
        "read-expanded" => {
            let numel: u64 = args[1].parse()?;
            rustix::process::setrlimit(
                rustix::process::Resource::As,
                rustix::process::Rlimit { current: Some(16 << 30), maximum: None },
            )?;
            let view = Tensor::new(&[7u8], &[1])?.expand(&[numel])?;
            say("expanded");
            match view.to_vec::<u8>() {
                Ok(v) => say(&format!("to_vec ok {}", v.len())),
                Err(error) => say(&format!("to_vec error {error:?}")),
            }
            match view.to_bytes() {
                Ok(v) => say(&format!("to_bytes ok {}", v.len())),
                Err(error) => say(&format!("to_bytes error {error:?}")),
            }
        }
        // Binds `endpoint`, says "bound", receives `count` tensors and holds them all, says
        // "held", then waits for stdin to close (the test kills it while it holds them).
        "hold" => {
            let mut receiver = Receiver::<Tensor>::bind(args[1].as_str())?;
            say("bound");
            let count: usize = args[2].parse()?;
            let mut held = Vec::new();
            for _ in 0..count {
                held.push(receiver.recv_timeout(Duration::from_secs(60))?);
            }
            say("held");
            let _ = std::io::stdin().lock().lines().count();
            drop(held);
        }
        // Lowers RLIMIT_NOFILE to `limit`, connects to `endpoint`, then makes and sends `count`
        // 48 MiB tensors (a chunk each), holding every one: says "made error E" / "send error E"
        // for each failure, then "sent N" (how many sends succeeded).
        "fd-limit-tensors" => {
            let limit: u64 = args[2].parse()?;
            let count: usize = args[3].parse()?;
            let sender = connect::<Tensor>(&args[1])?;
            let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
            rustix::process::setrlimit(
                rustix::process::Resource::Nofile,
                rustix::process::Rlimit { current: Some(limit), maximum: hard },
            )?;
            let mut held = Vec::new();
            let mut sent = 0;
            for _ in 0..count {
                let tensor = match Tensor::zeros(tensor_queue::DType::U8, &[48 << 20]) {
                    Ok(t) => t,
                    Err(error) => {
                        say(&format!("made error {error:?}"));
                        continue;
                    }
                };
                match sender.send_timeout(&tensor, Duration::from_secs(30)) {
                    Ok(()) => sent += 1,
                    Err(error) => say(&format!("send error {error:?}")),
                }
                held.push(tensor);
            }
            say(&format!("sent {sent}"));
            // Room again: one more send goes through.
            held.clear();
            sender.send_timeout(&Tensor::new(&[1u8, 2, 3], &[3])?, Duration::from_secs(30))?;
            say("after");
            drop(sender);
        }
        other => bail!("unknown mode {other:?}"),
    }
    Ok(())
}
