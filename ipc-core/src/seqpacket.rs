//! Unix `SOCK_SEQPACKET` sockets: reliable, ordered, with message boundaries, so a message and
//! the descriptors attached to it always arrive together and whole.
//!
//! A listener's socket file is made readable and writable by its owner only, and removed when the
//! listener drops; a stale file left by a dead process is removed on bind.

use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::sockopt::{Timeout, set_socket_timeout, socket_peercred};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType, accept_with, bind, connect, listen};

use crate::{Error, Result, fd_passing};

fn seqpacket_socket() -> Result<OwnedFd> {
    rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(|e| Error::os("socket(AF_UNIX, SOCK_SEQPACKET)", e))
}

fn address(path: &Path) -> Result<SocketAddrUnix> {
    SocketAddrUnix::new(path).map_err(|e| Error::os("a Unix socket address (path too long?)", e))
}

/// A listening socket at a path.
#[derive(Debug)]
pub struct Listener {
    fd: OwnedFd,
    path: PathBuf,
}

impl Listener {
    /// Listens at `path`, replacing a stale socket file that nobody listens on.
    pub fn bind(path: impl AsRef<Path>) -> Result<Listener> {
        let path = path.as_ref().to_path_buf();
        if let Ok(meta) = std::fs::symlink_metadata(&path) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(Error::os(
                    "binding a socket",
                    std::io::Error::new(
                        ErrorKind::AlreadyExists,
                        format!("{} exists and is not a socket", path.display()),
                    ),
                ));
            }
            match Connection::connect(&path) {
                Ok(_) => {
                    return Err(Error::os(
                        "binding a socket",
                        std::io::Error::new(ErrorKind::AddrInUse, format!("{} is in use", path.display())),
                    ));
                }
                Err(_) => std::fs::remove_file(&path).map_err(|e| Error::os("removing a stale socket", e))?,
            }
        }
        let fd = seqpacket_socket()?;
        bind(&fd, &address(&path)?).map_err(|e| Error::os("bind", e))?;
        let listener = Listener { fd, path };
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&listener.path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::os("chmod 0600 on the socket", e))?;
        listen(&listener.fd, 128).map_err(|e| Error::os("listen", e))?;
        Ok(listener)
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits up to `timeout` (forever with `None`) for the next connection.
    pub fn accept(&self, timeout: Option<Duration>) -> Result<Connection> {
        if let Some(timeout) = timeout
            && !wait_readable(self.fd.as_fd(), timeout)?
        {
            return Err(Error::os("accept", std::io::Error::new(ErrorKind::TimedOut, "no peer connected in time")));
        }
        loop {
            match accept_with(&self.fd, SocketFlags::CLOEXEC) {
                Ok(fd) => return Ok(Connection { fd }),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(Error::os("accept", e)),
            }
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
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether `fd` becomes readable within `timeout`.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> Result<bool> {
    let timespec = Timespec::try_from(timeout).map_err(|_| Error::InvalidArgument("timeout too long".into()))?;
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

    /// Sends one message with descriptors attached.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        fd_passing::send(&self.fd, bytes, fds)
    }

    /// Receives one message into `buf`; `Ok((0, _))` means the peer hung up. A message longer
    /// than `buf` is an error (the rest was discarded by the kernel).
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
}
