//! Rank 1 of the NCCL tests: a second process with its own GPU.
//!
//! `nccl-peer --device <ordinal> [--timeout-s <seconds>]` reads the communicator's unique id (hex)
//! as its first line of standard input, joins as rank 1 of 2 on that GPU, and prints `ready`.
//! Then each line is a command: `recv <bytes>` receives that many bytes from rank 0 and prints
//! `checksum <hex>` (the kernels crate's checksum of what arrived); `send <bytes> <seed>` sends
//! that many bytes of the kernels crate's pattern to rank 0 and prints the checksum of what it
//! sent, the same way; `quit` releases the
//! communicator, prints `bye` and exits. Errors go to standard error, with exit status 1.

use std::io::{BufRead, Write};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use integration_tests::{from_hex, number};
use ipc_core::nccl::{Communicator, UniqueId};
use ipc_core::{Context, DeviceBuffer, Stream};
use kernels::Kernels;

fn main() {
    if let Err(error) = run() {
        eprintln!("nccl-peer: {error:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let device = number(&args, "--device", 1)? as i32;
    let timeout = Duration::from_secs(number(&args, "--timeout-s", 30)?);
    let mut lines = std::io::stdin().lock().lines();
    let mut next_line = || -> Result<String> { lines.next().context("standard input closed")?.map_err(Into::into) };
    let id = UniqueId::try_from(from_hex(&next_line()?)?.as_slice())?;

    let context = Context::on_ordinal(device)?;
    let communicator = Communicator::init(&context, &id, 2, 1, timeout)?;
    let stream = Stream::new(&context)?;
    let kernels = Kernels::get(&context)?;
    say("ready")?;
    loop {
        let line = next_line()?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["recv", bytes] => {
                let len: usize = bytes.parse().with_context(|| format!("recv {bytes}"))?;
                let buffer = DeviceBuffer::alloc(&context, len)?;
                communicator.recv(&buffer, 0, len, 0, &stream)?;
                communicator.wait(&stream)?;
                let checksum = kernels.checksum(&buffer, 0, len, &stream)?;
                say(&format!("checksum {checksum:x}"))?;
            }
            ["send", bytes, seed] => {
                let len: usize = bytes.parse().with_context(|| format!("send {bytes}"))?;
                let buffer = DeviceBuffer::alloc(&context, len)?;
                kernels.fill(&buffer, 0, len, seed.parse()?, &stream)?;
                let checksum = kernels.checksum(&buffer, 0, len, &stream)?;
                communicator.send(&buffer, 0, len, 0, &stream)?;
                communicator.wait(&stream)?;
                say(&format!("checksum {checksum:x}"))?;
            }
            ["quit"] => {
                let started = std::time::Instant::now();
                drop(communicator);
                eprintln!("nccl-peer: released its communicator in {:?}", started.elapsed());
                return say("bye");
            }
            _ => bail!("unknown command {line:?}"),
        }
    }
}

fn say(line: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()?;
    Ok(())
}
