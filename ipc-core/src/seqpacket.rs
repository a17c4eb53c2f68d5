//! Unix `SOCK_SEQPACKET` sockets: reliable, ordered, with message boundaries, so a message and
//! the descriptors attached to it always arrive together and whole.
//!
//! A listener's socket file is made readable and writable by its owner only, and removed when the
//! listener drops; a stale file left by a dead process is removed on bind.
//!
//! # Binding without races
//! Checking for a stale file, removing it and binding are three steps. Two processes racing
//! through them for one path could both bind (the second removing the first's fresh file), and
//! the loser, when it dropped, would remove the winner's file. So every listener takes an
//! exclusive `flock` on the socket's directory for those steps and for the removal in `Drop`,
//! and removes the file only if it is still the one it bound (same device and inode).

use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::fs::{FlockOperation, Mode, OFlags, flock};
use rustix::io::Errno;
use rustix::net::sockopt::{Timeout, set_socket_timeout, socket_peercred};
use rustix::net::{
    AddressFamily, Shutdown, SocketAddrUnix, SocketFlags, SocketType, accept_with, bind, connect, listen, shutdown,
};

use crate::{Error, Result, fd_passing};

fn seqpacket_socket() -> Result<OwnedFd> {
    rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(|e| Error::os("socket(AF_UNIX, SOCK_SEQPACKET)", e))
}

fn address(path: &Path) -> Result<SocketAddrUnix> {
    SocketAddrUnix::new(path).map_err(|e| Error::os("a Unix socket address (path too long?)", e))
}

fn bind_error(kind: ErrorKind, message: String) -> Error {
    Error::os("binding a socket", std::io::Error::new(kind, message))
}

/// An exclusive `flock` on a directory, held while this value lives (the kernel releases it when
/// the descriptor closes, also if the process dies).
struct DirectoryLock(#[expect(dead_code, reason = "held for its lock")] OwnedFd);

impl DirectoryLock {
    /// Locks the directory that holds `path`, waiting for other binders and droppers, for at
    /// most [`LOCK_PATIENCE`]: anyone who can open the directory can hold its lock (another user
    /// in `/tmp`, say), and a bind must fail then, not hang.
    fn of(path: &Path) -> Result<DirectoryLock> {
        let dir = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        let fd = rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| Error::os("opening the socket's directory", e))?;
        let deadline = std::time::Instant::now() + LOCK_PATIENCE;
        loop {
            match flock(&fd, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(DirectoryLock(fd)),
                Err(Errno::INTR) => continue,
                Err(Errno::WOULDBLOCK) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(Errno::WOULDBLOCK) => {
                    return Err(Error::os(
                        "locking the socket's directory",
                        std::io::Error::new(
                            ErrorKind::WouldBlock,
                            format!("{} stayed locked by another process for {LOCK_PATIENCE:?}", dir.display()),
                        ),
                    ));
                }
                Err(e) => return Err(Error::os("locking the socket's directory", e)),
            }
        }
    }
}

/// How long a bind (or a listener's removal of its file) waits for the directory's lock.
const LOCK_PATIENCE: Duration = Duration::from_secs(5);

/// What identifies the file at `path` (device, inode), if there is one.
fn file_identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path).ok().map(|meta| (meta.dev(), meta.ino()))
}

/// Whether a listener accepts connections at `path` (a socket file nobody listens on is stale).
/// Only a refusal says nobody listens: a listener of another socket type (a stream server's,
/// which refuses our type with `EPROTOTYPE`) is not ours to take over (a bind replaced a live
/// server's socket file; outside tester, Python round 9, finding 8).
fn is_listening(path: &Path) -> Result<bool> {
    // Non-blocking, so a live listener with a full backlog answers at once instead of holding
    // the directory lock until it accepts.
    let probe = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| Error::os("socket(AF_UNIX, SOCK_SEQPACKET)", e))?;
    match connect(&probe, &address(path)?) {
        Err(Errno::CONNREFUSED | Errno::NOENT) => Ok(false),
        Ok(()) | Err(_) => Ok(true),
    }
}

/// A listening socket at a path.
#[derive(Debug)]
pub struct Listener {
    fd: OwnedFd,
    path: PathBuf,
    /// The socket file this listener bound, to remove that file and no other.
    identity: (u64, u64),
    stopped: AtomicBool,
}

impl Listener {
    /// Listens at `path`, replacing a stale socket file that nobody listens on.
    pub fn bind(path: impl AsRef<Path>) -> Result<Listener> {
        let path = path.as_ref().to_path_buf();
        let _lock = DirectoryLock::of(&path)?;
        if let Ok(meta) = std::fs::symlink_metadata(&path) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(bind_error(
                    ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            if is_listening(&path)? {
                return Err(bind_error(ErrorKind::AddrInUse, format!("{} is in use", path.display())));
            }
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(Error::os("removing a stale socket", e)),
            }
        }
        let fd = seqpacket_socket()?;
        bind(&fd, &address(&path)?).map_err(|e| Error::os("bind", e))?;
        let identity = file_identity(&path)
            .ok_or_else(|| bind_error(ErrorKind::NotFound, format!("{} vanished right after bind", path.display())))?;
        // Chmod before `listen`: until then connecting is refused, so nobody connects through a
        // file with the umask's wider mode.
        use std::os::unix::fs::PermissionsExt;
        let listening = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::os("chmod 0600 on the socket", e))
            .and_then(|()| listen(&fd, 128).map_err(|e| Error::os("listen", e)));
        if let Err(error) = listening {
            // Not through `Drop`, which would wait for the directory lock this thread holds.
            let _ = std::fs::remove_file(&path);
            return Err(error);
        }
        Ok(Listener { fd, path, identity, stopped: AtomicBool::new(false) })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits up to `timeout` (forever with `None`) for the next connection.
    ///
    /// After [`Listener::wake`] it fails at once with [`Error::ListenerStopped`].
    pub fn accept(&self, timeout: Option<Duration>) -> Result<Connection> {
        if let Some(timeout) = timeout
            && !wait_readable(self.fd.as_fd(), timeout)?
        {
            return Err(Error::os("accept", std::io::Error::new(ErrorKind::TimedOut, "no peer connected in time")));
        }
        loop {
            if self.stopped.load(Ordering::Acquire) {
                return Err(Error::ListenerStopped);
            }
            match accept_with(&self.fd, SocketFlags::CLOEXEC) {
                Ok(fd) => return Ok(Connection { fd }),
                Err(Errno::INTR) => continue,
                // What accept on a shut-down listening socket answers; the flag says it was us.
                Err(Errno::INVAL) if self.stopped.load(Ordering::Acquire) => return Err(Error::ListenerStopped),
                Err(e) => return Err(Error::os("accept", e)),
            }
        }
    }

    /// Stops the listener: threads waiting in [`Listener::accept`], or polling it for
    /// readability ([`wait_readable`], or a poll set with this listener in it), return at once,
    /// and every later `accept` fails with [`Error::ListenerStopped`]. Peers that connect from
    /// now on are refused. The socket file stays until the listener drops.
    ///
    /// This lets the owner of an accept thread stop it without waiting for a timeout.
    pub fn wake(&self) {
        self.stopped.store(true, Ordering::Release);
        // Shutting down a listening socket makes `poll` report it (hang-up) and wakes `accept`.
        if let Err(error) = shutdown(&self.fd, Shutdown::Both) {
            tracing::warn!(%error, "shutting down a listening socket failed");
        }
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Without the lock (the directory is gone or unreadable) the identity check still keeps
        // us from removing a file another listener bound.
        let _lock = DirectoryLock::of(&self.path).ok();
        if file_identity(&self.path) == Some(self.identity) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Whether `fd` becomes readable within `timeout`.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> Result<bool> {
    let timespec = Timespec::try_from(crate::deadline::bounded(timeout))
        .map_err(|_| Error::InvalidArgument("timeout too long".into()))?;
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    loop {
        match poll(&mut fds, Some(&timespec)) {
            Ok(n) => return Ok(n > 0),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(Error::os("poll", e)),
        }
    }
}

/// One end of a connection.
#[derive(Debug)]
pub struct Connection {
    fd: OwnedFd,
}

/// The process at the other end of a connection, as the kernel recorded it at connect time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCredentials {
    /// Process id.
    pub pid: i32,
    /// User id.
    pub uid: u32,
}

impl Connection {
    /// Connects to a listener at `path`.
    pub fn connect(path: impl AsRef<Path>) -> Result<Connection> {
        let fd = seqpacket_socket()?;
        loop {
            match connect(&fd, &address(path.as_ref())?) {
                Ok(()) => return Ok(Connection { fd }),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(Error::os("connect", e)),
            }
        }
    }

    /// A connected pair, for tests and threads.
    pub fn pair() -> Result<(Connection, Connection)> {
        let (a, b) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
            .map_err(|e| Error::os("socketpair", e))?;
        Ok((Connection { fd: a }, Connection { fd: b }))
    }

    /// Sends one message (at least one byte) with descriptors attached, waiting for room.
    /// [`Error::PeerGone`] if the peer closed the connection.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        fd_passing::send(&self.fd, bytes, fds)
    }

    /// Like [`Connection::send`], but `Ok(false)` at once, with nothing sent, when the socket's
    /// buffer has no room for the message.
    pub fn try_send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<bool> {
        fd_passing::try_send(&self.fd, bytes, fds)
    }

    /// Receives one message into `buf`; `Ok((0, _))` means the peer hung up. A message longer
    /// than `buf` is an error (the rest was discarded by the kernel), and so is an empty one
    /// ([`Error::EmptyMessage`]).
    pub fn recv(&self, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
        fd_passing::recv(&self.fd, buf)
    }

    /// Like [`Connection::recv`], but `Ok(None)` at once when nothing is waiting: one system call
    /// where `poll` and then `recv` would be two.
    pub fn try_recv(&self, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>> {
        fd_passing::try_recv(&self.fd, buf)
    }

    /// Makes `recv` fail with a timeout after `timeout` (`None`: wait forever).
    pub fn set_recv_timeout(&self, timeout: Option<Duration>) -> Result<()> {
        set_socket_timeout(&self.fd, Timeout::Recv, timeout).map_err(|e| Error::os("SO_RCVTIMEO", e))
    }

    /// Makes `send` give up after `timeout` (`None`: wait forever) without room for its message:
    /// it then fails with an [`Error::Os`] of kind [`ErrorKind::WouldBlock`], having sent nothing.
    pub fn set_send_timeout(&self, timeout: Option<Duration>) -> Result<()> {
        set_socket_timeout(&self.fd, Timeout::Send, timeout).map_err(|e| Error::os("SO_SNDTIMEO", e))
    }

    /// Who is at the other end (`SO_PEERCRED`).
    pub fn peer_credentials(&self) -> Result<PeerCredentials> {
        let credentials = socket_peercred(&self.fd).map_err(|e| Error::os("SO_PEERCRED", e))?;
        Ok(PeerCredentials { pid: credentials.pid.as_raw_nonzero().get(), uid: credentials.uid.as_raw() })
    }
}

impl From<OwnedFd> for Connection {
    /// Wraps a connected `SOCK_SEQPACKET` socket, for example one received from another thread
    /// or process.
    fn from(fd: OwnedFd) -> Connection {
        Connection { fd }
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_keep_their_boundaries_and_peers_are_known() {
        let dir = std::env::temp_dir().join(format!("ipc-core-seqpacket-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let listener = Listener::bind(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let client = Connection::connect(&path).unwrap();
        let server = listener.accept(Some(Duration::from_secs(5))).unwrap();
        client.send(b"one", &[]).unwrap();
        client.send(b"two!", &[]).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(server.recv(&mut buf).unwrap().0, 3);
        assert_eq!(server.recv(&mut buf).unwrap().0, 4);
        let peer = server.peer_credentials().unwrap();
        assert_eq!(peer.pid as u32, std::process::id());
        assert_eq!(peer.uid, rustix::process::getuid().as_raw());
        drop(client);
        assert_eq!(server.recv(&mut buf).unwrap().0, 0, "hang-up reads as an empty message");
        assert!(Listener::bind(&path).is_err(), "a live socket is not replaced");
        drop(listener);
        assert!(!path.exists(), "the socket file is removed");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap()); // leaves a stale socket file
        let _stale_replaced = Listener::bind(&path).unwrap();
        let not_a_socket = dir.join("file");
        std::fs::write(&not_a_socket, b"").unwrap();
        assert!(Listener::bind(&not_a_socket).is_err(), "only socket files are replaced");
    }

    /// Linux reports `ECONNRESET` to the survivor when a Unix socket closes with unread data of its
    /// own, before the messages still queued for the survivor: those must not be lost.
    #[test]
    fn messages_sent_before_a_reset_are_still_delivered() {
        let (survivor, leaving) = Connection::pair().unwrap();
        leaving.send(b"last words", &[]).unwrap();
        survivor.send(b"never read", &[]).unwrap();
        drop(leaving);
        let mut buf = [0u8; 32];
        let (n, _) = survivor.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"last words");
        assert_eq!(survivor.recv(&mut buf).unwrap().0, 0, "then the hang-up");
    }

    #[test]
    fn accept_times_out() {
        let path = std::env::temp_dir().join(format!("ipc-core-timeout-{}", std::process::id()));
        let listener = Listener::bind(&path).unwrap();
        assert!(listener.accept(Some(Duration::from_millis(20))).is_err());
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ipc-core-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn racing_binders_of_a_stale_path_leave_one_live_listener() {
        let path = temp_dir("race").join("s");
        let start = std::sync::Barrier::new(4);
        for round in 0..200 {
            drop(std::os::unix::net::UnixListener::bind(&path).unwrap()); // a stale socket file
            let results: Vec<Result<Listener>> = std::thread::scope(|scope| {
                let binders: Vec<_> = (0..4)
                    .map(|_| {
                        scope.spawn(|| {
                            start.wait();
                            Listener::bind(&path)
                        })
                    })
                    .collect();
                binders.into_iter().map(|binder| binder.join().unwrap()).collect()
            });
            let (mut winners, losers): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
            assert_eq!(winners.len(), 1, "round {round}: one binder wins; the others saw {losers:?}");
            let winner = winners.pop().unwrap().unwrap();
            drop(losers);
            assert!(path.exists(), "round {round}: the losers left the winner's file");
            Connection::connect(&path).unwrap();
            drop(winner);
            assert!(!path.exists(), "round {round}: the winner removes its file");
        }
    }

    #[test]
    fn dropping_a_listener_whose_file_was_replaced_keeps_the_new_file() {
        let path = temp_dir("replaced").join("s");
        let orphan = Listener::bind(&path).unwrap();
        std::fs::remove_file(&path).unwrap(); // as a careless cleanup script would
        let live = Listener::bind(&path).unwrap();
        drop(orphan);
        assert!(path.exists(), "the orphan removed the live listener's file");
        Connection::connect(&path).unwrap();
        live.accept(Some(Duration::from_secs(5))).unwrap();
    }

    #[test]
    fn wake_returns_waiting_threads_at_once() {
        let path = temp_dir("wake").join("s");
        let listener = std::sync::Arc::new(Listener::bind(&path).unwrap());
        let (done, finished) = std::sync::mpsc::channel();
        let waiting = listener.clone();
        let blocked = done.clone();
        std::thread::spawn(move || blocked.send(("blocking accept", waiting.accept(None).map(drop))));
        let waiting = listener.clone();
        let polled = done.clone();
        std::thread::spawn(move || {
            let readable = wait_readable(waiting.as_fd(), Duration::from_secs(60)).map(|readable| assert!(readable));
            polled.send(("poll", readable))
        });
        let waiting = listener.clone();
        std::thread::spawn(move || {
            done.send(("accept with a timeout", waiting.accept(Some(Duration::from_secs(60))).map(drop)))
        });
        std::thread::sleep(Duration::from_millis(50)); // let them block (if they do not yet, no matter)
        listener.wake();
        let mut stopped = Vec::new();
        for _ in 0..3 {
            let (who, result) = finished.recv_timeout(Duration::from_secs(5)).expect("a waiter was not woken");
            match result {
                Err(Error::ListenerStopped) => stopped.push(who),
                Ok(()) if who == "poll" => {}
                other => panic!("{who}: {other:?}"),
            }
        }
        assert_eq!(stopped.len(), 2, "{stopped:?}");
        assert!(matches!(listener.accept(Some(Duration::from_secs(1))), Err(Error::ListenerStopped)));
        assert!(Connection::connect(&path).is_err(), "a stopped listener refuses peers");
    }

    #[test]
    fn try_send_says_when_the_buffer_is_full_and_sends_whole_messages() {
        let (sender, receiver) = Connection::pair().unwrap();
        let message = [7u8; 1000];
        let mut sent = 0;
        while sender.try_send(&message, &[]).unwrap() {
            sent += 1;
            assert!(sent < 1_000_000, "the buffer never filled");
        }
        assert!(sent > 0);
        let mut buf = [0u8; 2000];
        for _ in 0..sent {
            assert_eq!(receiver.recv(&mut buf).unwrap().0, message.len());
        }
        assert!(receiver.try_recv(&mut buf).unwrap().is_none(), "the refused message left nothing behind");
        assert!(sender.try_send(&message, &[]).unwrap(), "room again");
    }

    #[test]
    fn a_send_timeout_gives_up_on_a_full_buffer() {
        let (sender, _receiver) = Connection::pair().unwrap();
        while sender.try_send(&[1u8; 1000], &[]).unwrap() {}
        sender.set_send_timeout(Some(Duration::from_millis(100))).unwrap();
        let start = std::time::Instant::now();
        match sender.send(&[1u8; 1000], &[]) {
            Err(Error::Os { source, .. }) => assert_eq!(source.kind(), ErrorKind::WouldBlock),
            other => panic!("{other:?}"),
        }
        assert!(start.elapsed() >= Duration::from_millis(90), "gave up after {:?}", start.elapsed());
        sender.set_send_timeout(None).unwrap();
    }
}
