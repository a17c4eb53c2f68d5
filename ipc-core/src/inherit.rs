//! Socket pairs for a child process: the child's ends cross `exec` as inherited descriptors,
//! their numbers in an environment variable, so no path exists that another user could create
//! first or connect to.
//! - An end's close-on-exec flag is cleared only in the child, between `fork` and `exec`, so
//!   children that other threads start at the same moment do not inherit it.
//! - The child takes its ends once ([`take_inherited_sockets`]) and sets close-on-exec on them
//!   again, so its own children do not inherit them either.
//!
//! This module holds the `unsafe` of the scheme (the `pre_exec` hook, and descriptors known only
//! by number), so that the crates above need none.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::io::{FdFlags, fcntl_dupfd_cloexec, fcntl_setfd};
use rustix::net::{AddressFamily, SocketType};

use crate::seqpacket::Connection;
use crate::{Error, Result};

/// Starts `command` with `count` socket pairs, the child's ends inherited and their numbers in
/// the environment variable `variable` (comma-separated); returns the child and our ends, in
/// order. A program that does not start is [`Error::Os`] with `what` "starting the child".
///
/// ```
/// use std::process::Command;
/// let mut command = Command::new("sh");
/// command.args(["-c", "test -n \"$DOC_SOCKETS\""]);
/// let (mut child, ours) = ipc_core::inherit::spawn_with_sockets(&mut command, "DOC_SOCKETS", 2)?;
/// assert_eq!(ours.len(), 2);
/// assert!(child.wait()?.success(), "the child saw the variable");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn spawn_with_sockets(command: &mut Command, variable: &str, count: usize) -> Result<(Child, Vec<Connection>)> {
    let mut ours = Vec::with_capacity(count);
    let mut theirs: Vec<OwnedFd> = Vec::with_capacity(count);
    for _ in 0..count {
        let (mine, child_end) = Connection::pair()?;
        // Above the standard streams, which the child's stdio set-up may replace before our hook runs.
        let child_end = fcntl_dupfd_cloexec(&child_end, 3).map_err(|e| Error::os("duplicating a socket", e))?;
        ours.push(mine);
        theirs.push(child_end);
    }
    let raws: Vec<RawFd> = theirs.iter().map(AsRawFd::as_raw_fd).collect();
    let listed = raws.iter().map(RawFd::to_string).collect::<Vec<_>>().join(",");
    // The hook stays on `command` after this call; disarmed, it does nothing if `command` is
    // spawned again (by then the numbers may name other descriptors).
    let armed = Arc::new(AtomicBool::new(true));
    let hook_armed = armed.clone();
    let hook = move || {
        if hook_armed.load(Ordering::Relaxed) {
            for &raw in &raws {
                // SAFETY: `raw` is open in the child, a copy of this process's descriptor table
                // at fork time, because `theirs` lives until the child has started; it is
                // borrowed only for this call.
                let fd = unsafe { BorrowedFd::borrow_raw(raw) };
                fcntl_setfd(fd, FdFlags::empty())?;
            }
        }
        Ok(())
    };
    // SAFETY: the hook runs in the child between `fork` and `exec`, where only async-signal-safe
    // calls are allowed: it reads an atomic and makes `fcntl` system calls (rustix calls the
    // kernel directly), and neither allocates nor takes a lock (the list was made before).
    unsafe { command.pre_exec(hook) };
    let started = command.env(variable, listed).spawn();
    armed.store(false, Ordering::Relaxed);
    // Our copies of the child's ends go, so that a child which exits without taking them hangs up.
    drop(theirs);
    let child = started.map_err(|e| Error::os("starting the child", e))?;
    Ok((child, ours))
}

/// Why [`take_inherited_sockets`] found no sockets to take.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TakeError {
    /// The variable is not set: this process was not started by [`spawn_with_sockets`].
    #[error("the variable is not set")]
    NotSet,
    /// The variable does not hold a list of descriptor numbers.
    #[error("{value:?} is not a list of descriptors")]
    NotAList {
        /// What it holds.
        value: String,
    },
    /// The sockets were taken before in this process: their numbers may name other files now.
    #[error("the sockets were already taken (once per process)")]
    AlreadyTaken,
    /// A listed descriptor is not open, or not a Unix `SOCK_SEQPACKET` socket.
    #[error("descriptor {fd} is not the socket spawn_with_sockets left")]
    NotASocket {
        /// The descriptor's number.
        fd: RawFd,
    },
    /// Setting a socket's close-on-exec flag failed.
    #[error(transparent)]
    Core(#[from] Error),
}

/// Whether this process has taken its inherited sockets: after that the numbers may name other
/// files, so they must never be wrapped again.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// In a child started by [`spawn_with_sockets`]: takes ownership of the sockets listed in
/// `variable`, once per process, setting close-on-exec on them again.
pub fn take_inherited_sockets(variable: &str) -> std::result::Result<Vec<OwnedFd>, TakeError> {
    if std::env::var_os(variable).is_some() && TAKEN.load(Ordering::Acquire) {
        return Err(TakeError::AlreadyTaken);
    }
    let raws = inherited(variable)?;
    if TAKEN.swap(true, Ordering::AcqRel) {
        return Err(TakeError::AlreadyTaken);
    }
    let mut fds = Vec::with_capacity(raws.len());
    for raw in raws {
        // SAFETY: `raw` is open and is a Unix `SOCK_SEQPACKET` socket (checked above), left open
        // for this process by `spawn_with_sockets` and owned by nothing else here; `TAKEN` makes
        // this the one `OwnedFd` ever made from it in this process.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        fcntl_setfd(&fd, FdFlags::CLOEXEC).map_err(|e| Error::os("setting close-on-exec", e))?;
        fds.push(fd);
    }
    Ok(fds)
}

/// The descriptors listed in `variable`, each open and a Unix `SOCK_SEQPACKET` socket. A
/// descriptor that is not open is [`TakeError::NotASocket`] too: a program started by a child
/// that took its sockets inherits the variable but not the sockets (close-on-exec again), and
/// the number may be free.
fn inherited(variable: &str) -> std::result::Result<Vec<RawFd>, TakeError> {
    let value = std::env::var(variable).map_err(|_| TakeError::NotSet)?;
    let raws = value
        .split(',')
        .map(|number| number.parse::<RawFd>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| TakeError::NotAList { value: value.clone() })?;
    for &raw in &raws {
        if crate::fd_passing::check_open(raw).is_err() {
            return Err(TakeError::NotASocket { fd: raw });
        }
        // SAFETY: `raw` is open (checked above) and borrowed only for these two queries.
        let borrowed = unsafe { BorrowedFd::borrow_raw(raw) };
        if !is_seqpacket_socket(borrowed) {
            return Err(TakeError::NotASocket { fd: raw });
        }
    }
    Ok(raws)
}

/// Whether this process holds the sockets listed in `variable` (taken already or not): not
/// merely whether the variable is set, which a program started by a child that took its
/// sockets inherits without them.
pub fn has_inherited_sockets(variable: &str) -> bool {
    inherited(variable).is_ok()
}

/// Whether `fd` is what [`spawn_with_sockets`] leaves: a Unix `SOCK_SEQPACKET` socket.
fn is_seqpacket_socket(fd: BorrowedFd<'_>) -> bool {
    let domain = rustix::net::sockopt::socket_domain(fd);
    let kind = rustix::net::sockopt::socket_type(fd);
    matches!((domain, kind), (Ok(AddressFamily::UNIX), Ok(SocketType::SEQPACKET)))
}

/// Whether descriptor `fd` of this process is open and has its close-on-exec flag set (read from
/// `/proc/self/fdinfo`, no descriptor borrowed); `None` where it is not open.
///
/// ```
/// let file = std::fs::File::open("/proc/self/stat")?;
/// use std::os::fd::AsRawFd;
/// assert_eq!(ipc_core::inherit::close_on_exec(file.as_raw_fd()), Some(true)); // std opens with O_CLOEXEC
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn close_on_exec(fd: RawFd) -> Option<bool> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    let flags = info.lines().find_map(|line| line.strip_prefix("flags:"))?.trim();
    let flags = u32::from_str_radix(flags, 8).ok()?;
    Some(flags & 0o2000000 != 0)
}
