//! Passing file descriptors between processes over Unix sockets (`SCM_RIGHTS`).
//!
//! Chosen over `pidfd_getfd`, which needs ptrace rights and fails in unprivileged containers and
//! across PID namespaces. Received descriptors arrive as `OwnedFd` with close-on-exec set.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, recvmsg, sendmsg,
};
use rustix::process::Resource;

use crate::{Error, Result};

/// The most descriptors one message carries.
pub const MAX_FDS: usize = 32;

/// How many descriptors [`reserve_table`] makes this process's descriptor table hold (or the
/// soft `RLIMIT_NOFILE`, if that is lower).
pub const RESERVED_TABLE: u32 = 1024;

/// Grows this process's descriptor table, once, to hold [`RESERVED_TABLE`] descriptors, so that
/// no descriptor opened or received later has to grow it.
///
/// Why: Linux grows the table of a process that has more than one thread under
/// `synchronize_rcu()` (`expand_fdtable`), and whichever call needs the next slot waits for it:
/// 5-20 ms on the GPU machine. A CUDA process holds dozens of descriptors, so the few that a
/// channel's first connection adds (rings, doorbells, a chunk) pushed the table past 64 and 128
/// slots in the middle of the first message: one `memfd_create` took 5.4 ms and one `recvmsg`
/// of four descriptors 15-20 ms (`tq-bench` set-up with `TQ_LOG=debug`, BENCHMARKS.md). Called
/// before the driver starts its threads (`cuInit`) and before a channel binds or connects,
/// while the process may still have one thread (then growing costs nothing); later calls
/// return at once. A table never shrinks; 1,024 slots cost 8 KiB and two bitmaps.
///
/// ```
/// ipc_core::fd_passing::reserve_table();
/// let status = std::fs::read_to_string("/proc/self/status").unwrap();
/// let slots: u32 = status.lines().find_map(|l| l.strip_prefix("FDSize:")).unwrap().trim().parse().unwrap();
/// let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(u64::MAX);
/// assert!(u64::from(slots) >= u64::from(ipc_core::fd_passing::RESERVED_TABLE).min(limit));
/// ```
pub fn reserve_table() {
    static RESERVED: std::sync::Once = std::sync::Once::new();
    RESERVED.call_once(|| {
        let limit = rustix::process::getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
        let highest = u64::from(RESERVED_TABLE).min(limit).saturating_sub(1) as RawFd;
        // The lowest free descriptor at or above `highest`: the table grows to hold it, and
        // stays grown when both are closed (at once). A failure (no descriptor left, a
        // sandbox without `/`) leaves the table to grow when needed, as before.
        let Ok(root) =
            rustix::fs::open("/", rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC, rustix::fs::Mode::empty())
        else {
            return;
        };
        let _ = rustix::io::fcntl_dupfd_cloexec(&root, highest);
    });
}

/// Sends all of `bytes` (at least one) with `fds` attached to the first byte.
///
/// A peer that closed the connection is [`Error::PeerGone`].
pub fn send(socket: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    check_message(bytes, fds)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    send_rest(socket.as_fd(), bytes, 0, control_for(&mut space, fds)?)
}

/// Sends `bytes` with `fds` attached if the socket has room for them now: `Ok(false)`, having
/// sent nothing, if it has not (`MSG_DONTWAIT`).
///
/// On a `SOCK_SEQPACKET` socket (all of [`crate::seqpacket`]) a message goes whole or not at
/// all. On a stream socket a message the kernel took only in part is finished by waiting, so
/// that no message is ever cut.
pub fn try_send(socket: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<bool> {
    check_message(bytes, fds)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = control_for(&mut space, fds)?;
    let flags = SendFlags::NOSIGNAL | SendFlags::DONTWAIT;
    let sent = loop {
        match sendmsg(&socket, &[IoSlice::new(bytes)], &mut control, flags) {
            Ok(n) => break n,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => return Ok(false),
            Err(errno) => return Err(send_error(errno)),
        }
    };
    // The descriptors went with the first chunk.
    send_rest(socket.as_fd(), bytes, sent, SendAncillaryBuffer::default())?;
    Ok(true)
}

fn check_message(bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.len() > MAX_FDS {
        return Err(Error::InvalidArgument(format!("{} descriptors in one message; at most {MAX_FDS}", fds.len())));
    }
    if bytes.is_empty() {
        // And descriptors must travel with at least one byte.
        return Err(Error::InvalidArgument("an empty message would read like a hang-up".into()));
    }
    Ok(())
}

fn control_for<'a>(
    space: &'a mut [MaybeUninit<u8>],
    fds: &'a [BorrowedFd<'a>],
) -> Result<SendAncillaryBuffer<'a, 'a, 'a>> {
    let mut control = SendAncillaryBuffer::new(space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Error::InvalidArgument("descriptors do not fit the control buffer".into()));
    }
    Ok(control)
}

/// Sends `bytes[sent..]`, waiting for room; `control` goes with the first chunk.
fn send_rest(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    mut sent: usize,
    mut control: SendAncillaryBuffer<'_, '_, '_>,
) -> Result<()> {
    while sent < bytes.len() {
        match sendmsg(socket, &[IoSlice::new(&bytes[sent..])], &mut control, SendFlags::NOSIGNAL) {
            Ok(n) => {
                sent += n;
                // The descriptors went with the first chunk.
                control = SendAncillaryBuffer::default();
            }
            Err(Errno::INTR) => continue,
            Err(errno) => return Err(send_error(errno)),
        }
    }
    Ok(())
}

/// One error for a dead peer: `EPIPE` (it closed), or `ECONNRESET` (it closed with messages
/// from us unread, reported once before `EPIPE`).
fn send_error(errno: Errno) -> Error {
    match errno {
        Errno::PIPE | Errno::CONNRESET => Error::PeerGone,
        errno => Error::os("sendmsg", errno),
    }
}

/// Receives up to `buf.len()` bytes and the descriptors that came with them.
///
/// Returns `(0, [])` when the peer has closed the connection (or shut it down for writing). An
/// empty message from a peer still connected is [`Error::EmptyMessage`], so that no peer can
/// fake a hang-up. If the peer attached more than [`MAX_FDS`] descriptors the kernel drops the
/// excess; that is reported as an error (and the descriptors that did arrive are closed), as
/// [`Error::DescriptorTableFull`] when this process had no room for them (the message's bytes
/// are in `buf` then, their length in the error).
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
        let open = open_descriptors();
        drop(fds);
        return Err(match descriptor_shortage(open, rustix::process::getrlimit(Resource::Nofile).current) {
            Some(limit) => Error::DescriptorTableFull { limit, received: message.bytes },
            None => Error::InvalidArgument(format!("the peer sent more than {MAX_FDS} descriptors in one message")),
        });
    }
    if message.bytes == 0 && !hung_up(socket.as_fd())? {
        return Err(Error::EmptyMessage);
    }
    Ok(Some((message.bytes, fds)))
}

/// Whether the peer has hung up (or we shut the socket down for reading): a read of 0 bytes is
/// end-of-file then, and an empty message otherwise. For `SOCK_SEQPACKET` both read alike.
fn hung_up(socket: BorrowedFd<'_>) -> Result<bool> {
    let mut fds = [PollFd::new(&socket, PollFlags::IN | PollFlags::RDHUP)];
    loop {
        match poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })) {
            Ok(_) => break,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(Error::os("poll", e)),
        }
    }
    Ok(fds[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP))
}

/// How many descriptors this process has open, or `None` if there is no room to count them.
fn open_descriptors() -> Option<u64> {
    // Listing the directory takes a descriptor itself: failing for want of one answers the question.
    std::fs::read_dir("/proc/self/fd").ok().map(|entries| entries.count() as u64)
}

/// The limit to name when descriptors were lost: `Some(soft limit)` when `open` (`None`: too
/// many to count) leaves fewer than [`MAX_FDS`] free under it, so that a message's descriptors
/// may not have fit. `None` when there was room, so the peer sent more than [`MAX_FDS`].
fn descriptor_shortage(open: Option<u64>, soft_limit: Option<u64>) -> Option<u64> {
    let limit = soft_limit?;
    match open {
        None => Some(limit),
        Some(open) => (open.saturating_add(MAX_FDS as u64) >= limit).then_some(limit),
    }
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
        assert!(matches!(send(&a, b"", &[]), Err(Error::InvalidArgument(_))), "it would read like a hang-up");
        assert!(matches!(try_send(&a, b"", &[]), Err(Error::InvalidArgument(_))));
        assert!(matches!(check_open(987_654), Err(Error::BadDescriptor { fd: 987_654, .. })));
        assert!(matches!(check_open(-1), Err(Error::BadDescriptor { .. })));
        assert!(check_open(0).is_ok() || check_open(1).is_ok());
    }

    fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
        rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    }

    /// Sends `bytes` with `fds` attached, bypassing [`send`]'s checks, as a hostile peer could.
    fn raw_send(socket: &OwnedFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2 * MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(fds.is_empty() || control.push(SendAncillaryMessage::ScmRights(fds)));
        assert_eq!(sendmsg(socket, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL).unwrap(), bytes.len());
    }

    #[test]
    fn a_dead_peer_is_one_error_on_send() {
        let (survivor, leaving) = seqpacket_pair();
        send(&survivor, b"never read", &[]).unwrap();
        // Closing with our message unread makes the first send fail with ECONNRESET, the next EPIPE.
        drop(leaving);
        assert!(matches!(send(&survivor, b"x", &[]), Err(Error::PeerGone)));
        assert!(matches!(send(&survivor, b"x", &[]), Err(Error::PeerGone)));
        assert!(matches!(try_send(&survivor, b"x", &[]), Err(Error::PeerGone)));
        assert_eq!(Error::PeerGone.to_string(), "the peer closed the connection");
    }

    #[test]
    fn an_empty_message_is_not_a_hang_up() {
        let (hostile, b) = seqpacket_pair();
        let memfd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        raw_send(&hostile, b"", &[]);
        raw_send(&hostile, b"", &[memfd.as_fd()]);
        send(&hostile, b"after", &[]).unwrap();
        let mut buf = [0u8; 16];
        assert!(matches!(recv(&b, &mut buf), Err(Error::EmptyMessage)));
        assert!(matches!(try_recv(&b, &mut buf), Err(Error::EmptyMessage)), "with descriptors too");
        assert_eq!(recv(&b, &mut buf).unwrap().0, 5, "the connection goes on");
        rustix::net::shutdown(&hostile, rustix::net::Shutdown::Write).unwrap();
        assert_eq!(recv(&b, &mut buf).unwrap().0, 0, "a peer that stops writing has hung up");
        drop(hostile);
        assert_eq!(recv(&b, &mut buf).unwrap().0, 0, "and so has one that closes");
        assert_eq!(try_recv(&b, &mut buf).unwrap().map(|(n, _)| n), Some(0));
    }

    #[test]
    fn too_many_descriptors_are_named_as_such() {
        let (a, b) = seqpacket_pair();
        let fds: Vec<BorrowedFd<'_>> = (0..MAX_FDS + 8).map(|_| a.as_fd()).collect();
        raw_send(&a, b"x", &fds);
        let error = recv(&b, &mut [0u8; 4]).unwrap_err();
        assert!(matches!(error, Error::InvalidArgument(ref m) if m.contains("more than 32")), "{error}");
    }

    #[test]
    fn a_nearly_full_table_is_named_with_its_limit() {
        assert_eq!(descriptor_shortage(Some(1000), Some(1024)), Some(1024));
        assert_eq!(descriptor_shortage(Some(1024), Some(1024)), Some(1024));
        assert_eq!(descriptor_shortage(None, Some(64)), Some(64), "no room even to count");
        assert_eq!(descriptor_shortage(Some(10), Some(1024)), None, "room: the peer sent too many");
        assert_eq!(descriptor_shortage(Some(10), None), None, "no limit");
        let message = Error::DescriptorTableFull { limit: 1024, received: 0 }.to_string();
        assert!(message.contains("1024") && message.contains("ulimit -n"), "{message}");
    }

    /// Set in the child that [`lost_descriptors_in_a_full_table_name_the_limit`] starts.
    const FULL_TABLE_CHILD: &str = "IPC_CORE_TEST_FULL_TABLE_CHILD";

    /// Lowering `RLIMIT_NOFILE` would starve the tests running beside this one, so the test runs
    /// again in a child process of its own, where it is the only test.
    #[test]
    fn lost_descriptors_in_a_full_table_name_the_limit() {
        let name = "fd_passing::tests::lost_descriptors_in_a_full_table_name_the_limit";
        if std::env::var_os(FULL_TABLE_CHILD).is_none() {
            let output = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", name, "--test-threads=1", "--nocapture"])
                .env(FULL_TABLE_CHILD, "1")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&output.stdout);
            assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
            assert!(stdout.contains("1 passed"), "the child ran the test: {stdout}");
            return;
        }
        let (a, b) = seqpacket_pair();
        let memfd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        send(&a, b"x", &[memfd.as_fd(), memfd.as_fd()]).unwrap();
        let nofile = rustix::process::Resource::Nofile;
        let saved = rustix::process::getrlimit(nofile);
        // Descriptors 0, 1 and 2 are open: no room for one more.
        rustix::process::setrlimit(nofile, rustix::process::Rlimit { current: Some(3), maximum: saved.maximum })
            .unwrap();
        let received = recv(&b, &mut [0u8; 4]);
        rustix::process::setrlimit(nofile, saved).unwrap();
        assert!(matches!(received, Err(Error::DescriptorTableFull { limit: 3, received: 1 })), "{received:?}");
    }
}
