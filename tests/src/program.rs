//! What the test programs (the second processes the tests start, `src/bin/`) share: a line to
//! the test on stdout, the retrying connect, the byte pattern of the outside tests, and the join
//! of a program's sender threads.

use std::io::Write as _;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use tensor_queue::Sender;

/// Prints one line and flushes it, so the test sees each step as it happens.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Connects, retrying for up to a minute while the other side is not bound yet.
pub fn connect<T: serde::Serialize>(endpoint: &str) -> Result<Sender<T>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Sender::<T>::connect(endpoint) {
            Ok(sender) => return Ok(sender),
            Err(e) if Instant::now() > deadline => return Err(e).context("connect"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// The byte pattern of message `n`: element `i` is `(i * 31 + n) % 251`.
pub fn pattern(len: usize, n: u8) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + n as usize) % 251) as u8).collect()
}

/// Waits for every sender thread: the first error, or a panic, is the program's.
pub fn join_senders(threads: Vec<JoinHandle<Result<()>>>) -> Result<()> {
    for thread in threads {
        thread.join().map_err(|_| anyhow::anyhow!("a sender thread panicked"))??;
    }
    Ok(())
}
