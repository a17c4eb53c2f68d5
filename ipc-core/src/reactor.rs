//! Descriptors registered with tokio's reactor (feature `tokio`): the one place that promises
//! tokio's registration contract, so that users of this crate need no `unsafe` for it.

use std::os::fd::OwnedFd;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// `fd`, owned and registered with the current tokio runtime's reactor for readability. Must be
/// called within a runtime with IO enabled (else tokio's error, or its panic where no runtime is
/// current: check `tokio::runtime::Handle::try_current` first).
///
/// ```
/// # fn main() -> std::io::Result<()> {
/// let runtime = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
/// let (a, _b) = std::os::unix::net::UnixStream::pair()?;
/// let registered = runtime.block_on(async { ipc_core::reactor::register_readable(a.into()) })?;
/// assert!(registered.get_ref().try_clone().is_ok());
/// # Ok(()) }
/// ```
pub fn register_readable(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` is open for as long as it lives, and the `AsyncFd` owns this one, so
    // the number stays the same open descriptor until the registration drops; `OwnedFd`'s
    // `as_raw_fd` always returns that number.
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(|e| e.into_parts().1)
}
