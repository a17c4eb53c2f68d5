//! Locks that survive a panic: every critical section of this crate leaves its state consistent
//! before anything that could panic, so a poisoned mutex still holds good data.

/// Locks `mutex`, taking the data even if a thread panicked while holding it.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
