//! A condition variable whose notify costs nothing when nobody waits.
//!
//! `std::sync::Condvar` (futex-based on Linux) makes a `FUTEX_WAKE` system call on every
//! `notify_*`, waiters or not. The channels notify once or twice per message (a lease ended, a
//! socket drained, credits came back) and almost never have a waiter: those calls were a
//! measurable part of a small message's cost (strace of a 4 KiB round trip over TCP: two futex
//! calls per message on the sending thread, none waking anybody). [`CountedCondvar`] counts its
//! waiters and skips the call when there are none.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, MutexGuard, PoisonError};
use std::time::Duration;

/// A `Condvar` that counts its waiters, so that notifying none makes no system call.
///
/// Correct under the usual discipline: the state waited for changes only while its mutex is
/// held, and a waiter checks it under that mutex before waiting. A waiter is counted before its
/// `wait` lets the mutex go, so a notifier that changed the state under the mutex afterwards
/// sees the count. Waits take the data of a poisoned mutex, as this workspace's `lock` helpers do.
#[derive(Debug, Default)]
pub struct CountedCondvar {
    condvar: Condvar,
    waiting: AtomicUsize,
}

impl CountedCondvar {
    /// A condition variable nobody waits on.
    pub const fn new() -> CountedCondvar {
        CountedCondvar { condvar: Condvar::new(), waiting: AtomicUsize::new(0) }
    }

    /// Waits until notified (or woken spuriously).
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let guard = self.condvar.wait(guard).unwrap_or_else(PoisonError::into_inner);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    /// Waits until notified (or woken spuriously), at most `timeout`.
    pub fn wait_timeout<'a, T>(&self, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let (guard, _) = self.condvar.wait_timeout(guard, timeout).unwrap_or_else(PoisonError::into_inner);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    /// Waits while `condition` holds, at most `timeout` in all (as `Condvar::wait_timeout_while`).
    pub fn wait_timeout_while<'a, T>(
        &self,
        mut guard: MutexGuard<'a, T>,
        timeout: Duration,
        mut condition: impl FnMut(&mut T) -> bool,
    ) -> MutexGuard<'a, T> {
        let deadline = crate::deadline::deadline(timeout);
        while condition(&mut guard) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            guard = self.wait_timeout(guard, left);
        }
        guard
    }

    /// Wakes one waiter, if there is one: for a change only one waiter can use (one credit),
    /// where waking all makes each of a thousand waiters take the mutex only to wait again. A
    /// waiter woken so that leaves something usable behind must pass it on with `notify_one`.
    pub fn notify_one(&self) {
        if self.waiting.load(Ordering::SeqCst) != 0 {
            self.condvar.notify_one();
        }
    }

    /// Wakes every waiter, if there is one.
    pub fn notify_all(&self) {
        if self.waiting.load(Ordering::SeqCst) != 0 {
            self.condvar.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    /// Waits under `value`'s lock until it is `target`; a wait that times out with the value
    /// unchanged was a lost wake-up (the other thread changes it, then notifies).
    fn await_value<'a>(
        mut guard: std::sync::MutexGuard<'a, u64>,
        changed: &CountedCondvar,
        target: u64,
    ) -> std::sync::MutexGuard<'a, u64> {
        const LONG: Duration = Duration::from_secs(5);
        while *guard != target {
            let started = Instant::now();
            guard = changed.wait_timeout(guard, LONG);
            assert!(*guard == target || started.elapsed() < LONG, "a wake-up was lost waiting for {target}");
        }
        guard
    }

    #[test]
    fn a_change_made_under_the_mutex_wakes_a_waiter_every_time() {
        let shared = Arc::new((Mutex::new(0u64), CountedCondvar::new()));
        let other = shared.clone();
        let rounds = 20_000u64;
        let peer = std::thread::spawn(move || {
            let (value, changed) = &*other;
            for round in 0..rounds {
                let mut guard = await_value(value.lock().unwrap(), changed, 2 * round + 1);
                *guard += 1;
                changed.notify_all();
            }
        });
        let (value, changed) = &*shared;
        for round in 0..rounds {
            let mut guard = value.lock().unwrap();
            *guard += 1;
            changed.notify_all();
            drop(await_value(guard, changed, 2 * round + 2));
        }
        peer.join().unwrap();
        assert_eq!(changed.waiting.load(Ordering::SeqCst), 0, "every waiter counted out");
    }
}
