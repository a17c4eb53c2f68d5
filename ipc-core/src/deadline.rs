//! Deadlines from callers' timeouts. A caller's "wait forever" is often `Duration::MAX`, which
//! `Instant + Duration` cannot hold (it panics): every wait of this workspace turns its timeout
//! into a deadline here, so such a timeout is a wait without end instead of a panic.

use std::time::{Duration, Instant};

/// The longest wait counted (about 136 years): a longer timeout waits this long, which is to
/// say without end. It also fits a `timespec` and a condition variable's wait.
pub const FOREVER: Duration = Duration::from_secs(u32::MAX as u64);

/// When a wait of `timeout` that starts now ends; a timeout longer than [`FOREVER`] is
/// [`FOREVER`].
///
/// ```
/// use std::time::{Duration, Instant};
/// use ipc_core::deadline::{FOREVER, deadline};
/// assert!(deadline(Duration::MAX) >= Instant::now() + FOREVER / 2);
/// assert!(deadline(Duration::from_millis(5)) <= Instant::now() + Duration::from_millis(5));
/// ```
pub fn deadline(timeout: Duration) -> Instant {
    let now = Instant::now();
    // `FOREVER` always fits CLOCK_MONOTONIC's seconds: the fallback cannot be reached on Linux.
    now.checked_add(timeout.min(FOREVER)).unwrap_or(now)
}

/// `timeout`, at most [`FOREVER`]: what a `poll` or a condition variable is given.
pub fn bounded(timeout: Duration) -> Duration {
    timeout.min(FOREVER)
}
