//! One clock for every process of the machine: the timestamps messages carry.

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use std::time::Duration;
/// use tensor_queue::{Receiver, Sender, monotonic_ns};
/// # let path = std::env::temp_dir().join(format!("doc-{}-monotonic.sock", std::process::id()));
/// let mut receiver = Receiver::<u64>::bind(&path)?;
/// let sender = Sender::<u64>::connect(&path)?; // usually in another process: the clock is the same
/// sender.send(&monotonic_ns())?;
/// let sent = receiver.recv()?;
/// let latency = Duration::from_nanos(monotonic_ns() - sent);
/// assert!(latency < Duration::from_secs(10));
/// # Ok(()) }
/// ```
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}
