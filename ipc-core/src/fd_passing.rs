//! Passing file descriptors between processes over Unix sockets (`SCM_RIGHTS`).
//!
//! Chosen over `pidfd_getfd`, which needs ptrace rights and fails in unprivileged containers and
//! across PID namespaces. Received descriptors arrive as `OwnedFd` with close-on-exec set.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};

use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, recvmsg, sendmsg,
};

use crate::{Error, Result};

/// The most descriptors one message carries.
pub const MAX_FDS: usize = 32;

/// Sends all of `bytes` with `fds` attached to the first byte.
pub fn send(socket: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.len() > MAX_FDS {
        return Err(Error::InvalidArgument(format!("{} descriptors in one message; at most {MAX_FDS}", fds.len())));
    }
    if bytes.is_empty() && !fds.is_empty() {
        return Err(Error::InvalidArgument("descriptors must travel with at least one byte".into()));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Error::InvalidArgument("descriptors do not fit the control buffer".into()));
    }
    let mut sent = 0;
    while sent < bytes.len() {
        match sendmsg(&socket, &[IoSlice::new(&bytes[sent..])], &mut control, SendFlags::NOSIGNAL) {
            Ok(n) => {
                sent += n;
                // The descriptors went with the first chunk.
                control = SendAncillaryBuffer::default();
            }
            Err(Errno::INTR) => continue,
            Err(errno) => return Err(Error::os("sendmsg", errno)),
        }
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and the descriptors that came with them.
///
/// Returns `(0, [])` when the peer has closed the connection. If the peer attached more than
/// [`MAX_FDS`] descriptors the kernel drops the excess; that is reported as an error (and the
/// descriptors that did arrive are closed).
pub fn recv(socket: impl AsFd, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
    recv_with(socket, buf, RecvFlags::CMSG_CLOEXEC).map(|received| received.unwrap_or_default())
}

/// Like [`recv`], but returns `Ok(None)` at once when nothing is waiting (`MSG_DONTWAIT`).
pub fn try_recv(socket: impl AsFd, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>> {
    recv_with(socket, buf, RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT)
}

fn recv_with(socket: impl AsFd, buf: &mut [u8], flags: RecvFlags) -> Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let message = loop {
        match recvmsg(&socket, &mut [IoSliceMut::new(buf)], &mut control, flags) {
            Ok(message) => break message,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) if flags.contains(RecvFlags::DONTWAIT) => return Ok(None),
            // A Unix socket whose peer closed with unread data of its own reports ECONNRESET once,
            // *before* the messages still queued here; reading on yields them, then end-of-file.
            Err(Errno::CONNRESET) => continue,
            Err(errno) => return Err(Error::os("recvmsg", errno)),
        }
    };
    let mut fds = Vec::new();
    for received in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = received {
            fds.extend(rights);
        }
    }
    if message.flags.contains(ReturnFlags::TRUNC) {
        return Err(Error::InvalidArgument(format!("a message longer than the {}-byte buffer", buf.len())));
    }
    if message.flags.contains(ReturnFlags::CTRUNC) {
        return Err(Error::InvalidArgument(format!("the peer sent more than {MAX_FDS} descriptors in one message")));
    }
    Ok(Some((message.bytes, fds)))
}

/// Checks that `fd` is open in this process, without taking ownership of it.
pub fn check_open(fd: RawFd) -> Result<()> {
    match std::fs::symlink_metadata(format!("/proc/self/fd/{fd}")) {
        Ok(_) if fd >= 0 => Ok(()),
        Ok(_) => {
            Err(Error::BadDescriptor { fd, source: std::io::Error::from_raw_os_error(Errno::BADF.raw_os_error()) })
        }
        Err(source) => Err(Error::BadDescriptor { fd, source }),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, Write};
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn descriptors_travel_with_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut file = std::fs::File::from(rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap());
        file.write_all(b"shared").unwrap();
        send(&a, b"hello", &[file.as_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = recv(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 1);
        let mut received = std::fs::File::from(fds.into_iter().next().unwrap());
        received.rewind().unwrap();
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        assert_eq!(text, "shared");
    }

    #[test]
    fn hang_up_reads_as_zero_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let (n, fds) = recv(&b, &mut [0u8; 4]).unwrap();
        assert_eq!((n, fds.len()), (0, 0));
    }

    #[test]
    fn bad_arguments_are_errors() {
        let (a, _b) = UnixStream::pair().unwrap();
        let fds: Vec<BorrowedFd<'_>> = (0..=MAX_FDS).map(|_| a.as_fd()).collect();
        assert!(matches!(send(&a, b"x", &fds), Err(Error::InvalidArgument(_))));
        assert!(matches!(send(&a, b"", &[a.as_fd()]), Err(Error::InvalidArgument(_))));
        assert!(matches!(check_open(987_654), Err(Error::BadDescriptor { fd: 987_654, .. })));
        assert!(matches!(check_open(-1), Err(Error::BadDescriptor { .. })));
        assert!(check_open(0).is_ok() || check_open(1).is_ok());
    }
}
