//! The seam under a channel: a connected socket that carries whole packets in order. A channel's
//! protocol is written once against [`Packets`]; two things implement it:
//!
//! | implementation | where | descriptors | who is at the other end |
//! | --- | --- | --- | --- |
//! | [`Connection`] (Unix `SOCK_SEQPACKET`) | one machine | passed (`SCM_RIGHTS`) | [`Peer::Local`]: pid and uid from `SO_PEERCRED` |
//! | [`TcpLink`] (authenticated TCP) | across hosts | never | [`Peer::Remote`]: it proved the shared secret |
//!
//! A packet is at most the caller's buffer long (the channel uses 64 KiB); an empty packet
//! never travels, so a read of length 0 means the peer hung up.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::SharedMemory;
use crate::seqpacket::Connection;
use crate::tcp::{Bulk, TcpLink};
use crate::{Error, Result};

/// Who is at the other end of a [`Packets`] link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// A process of this machine, as the kernel recorded it at connect time.
    Local {
        /// Its process id.
        pid: u32,
        /// Its user id.
        uid: u32,
    },
    /// A process elsewhere that proved it holds the shared secret.
    Remote(SocketAddr),
}

/// A connected socket carrying whole packets in order (see the module docs).
pub trait Packets: AsFd + Send + Sync + 'static {
    /// Sends one packet (with `fds` attached, where the link passes descriptors) if there is room
    /// now; `Ok(false)` with nothing sent if not. A packet taken arrives whole.
    /// [`Error::PeerGone`] once the peer has closed the connection.
    fn try_send(&self, packet: &[u8], fds: &[BorrowedFd<'_>]) -> Result<bool>;

    /// The next packet into `buf`, if one is whole, without waiting: `Some((0, _))` when the
    /// peer hung up.
    fn try_recv(&self, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>>;

    /// Waits for the next packet; `(0, _)` when the peer hung up.
    fn recv(&self, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
        loop {
            if let Some(read) = self.try_recv(buf)? {
                return Ok(read);
            }
            crate::seqpacket::wait_readable(self.as_fd(), std::time::Duration::from_secs(3600))?;
        }
    }

    /// Takes a bulk run of bytes written straight from their memory (see [`crate::tcp`]) if
    /// there is room to start it now, else gives it back; a run taken arrives whole, in order
    /// with the packets. Only byte streams carry runs: [`Error::InvalidArgument`] elsewhere.
    fn try_send_bulk(&self, bulk: Bulk) -> Result<std::result::Result<(), Bulk>> {
        drop(bulk);
        Err(Error::InvalidArgument("bulk runs cross TCP links only".into()))
    }

    /// Reads bytes of the bulk run next in the stream into `len` bytes at `offset` of
    /// `memory` without waiting (0: none has come yet). A read that finds a run next fails with
    /// [`Error::BulkAhead`], which says how many bytes it has. Only byte streams carry runs:
    /// [`Error::InvalidArgument`] elsewhere.
    fn try_recv_bulk_into(&self, memory: &SharedMemory, offset: usize, len: usize) -> Result<usize> {
        let _ = (memory, offset, len);
        Err(Error::InvalidArgument("bulk runs cross TCP links only".into()))
    }

    /// Whether a whole packet waits in this process already, where `poll` on the socket cannot
    /// see it (a byte stream reads ahead).
    fn has_buffered(&self) -> bool;

    /// How many bytes of a packet not yet whole were read already (a byte stream reads a packet
    /// in pieces): what is lost if the peer dies now.
    fn partial(&self) -> usize {
        0
    }

    /// When a packet taken earlier is still being written and holds up the next (a byte stream
    /// finishing a packet in the background), waits up to `timeout` for it to be out and returns
    /// true; returns false at once otherwise (then room in the socket is what to wait for).
    fn wait_sent(&self, timeout: std::time::Duration) -> bool {
        let _ = timeout;
        false
    }

    /// Bytes sent that the peer's machine has not acknowledged yet, which a process dying now
    /// could lose (see [`TcpLink::unacknowledged`]); 0 where the kernel hands a packet to the
    /// peer's socket as it is sent.
    fn unacknowledged(&self) -> usize {
        0
    }

    /// Closes one or both directions.
    fn shutdown(&self, how: rustix::net::Shutdown);

    /// Who is at the other end.
    fn peer(&self) -> Result<Peer>;

    /// Whether descriptors travel with packets.
    fn passes_descriptors(&self) -> bool;
}

impl Packets for Connection {
    fn try_send(&self, packet: &[u8], fds: &[BorrowedFd<'_>]) -> Result<bool> {
        Connection::try_send(self, packet, fds)
    }

    fn try_recv(&self, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>> {
        Connection::try_recv(self, buf)
    }

    fn recv(&self, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
        Connection::recv(self, buf)
    }

    fn has_buffered(&self) -> bool {
        false // the kernel keeps packets whole: poll sees every one
    }

    fn shutdown(&self, how: rustix::net::Shutdown) {
        let _ = rustix::net::shutdown(self, how);
    }

    fn peer(&self) -> Result<Peer> {
        let credentials = self.peer_credentials()?;
        Ok(Peer::Local { pid: credentials.pid as u32, uid: credentials.uid })
    }

    fn passes_descriptors(&self) -> bool {
        true
    }
}

impl Packets for TcpLink {
    fn try_send(&self, packet: &[u8], fds: &[BorrowedFd<'_>]) -> Result<bool> {
        if !fds.is_empty() {
            return Err(Error::InvalidArgument("file descriptors cannot cross a TCP link".into()));
        }
        TcpLink::try_send(self, packet)
    }

    fn try_recv(&self, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>> {
        let copied = self.try_recv_with(|packet| {
            let fits = packet.len() <= buf.len() && !packet.is_empty();
            if fits {
                buf[..packet.len()].copy_from_slice(packet);
            }
            (fits, packet.len())
        });
        match copied {
            Ok(Some((true, len))) => Ok(Some((len, Vec::new()))),
            Ok(Some((false, 0))) => Err(Error::EmptyMessage),
            Ok(Some((false, len))) => {
                TcpLink::shutdown(self);
                Err(Error::MessageTooLarge { len: len as u64, max: buf.len() })
            }
            Ok(None) => Ok(None),
            Err(Error::PeerGone) => Ok(Some((0, Vec::new()))),
            Err(error) => Err(error),
        }
    }

    fn try_send_bulk(&self, bulk: Bulk) -> Result<std::result::Result<(), Bulk>> {
        TcpLink::try_send_bulk(self, bulk)
    }

    fn try_recv_bulk_into(&self, memory: &SharedMemory, offset: usize, len: usize) -> Result<usize> {
        TcpLink::try_recv_bulk_into(self, memory, offset, len)
    }

    fn has_buffered(&self) -> bool {
        TcpLink::has_buffered(self)
    }

    fn partial(&self) -> usize {
        TcpLink::partial(self)
    }

    fn wait_sent(&self, timeout: std::time::Duration) -> bool {
        TcpLink::wait_sent(self, timeout)
    }

    fn unacknowledged(&self) -> usize {
        TcpLink::unacknowledged(self)
    }

    fn shutdown(&self, how: rustix::net::Shutdown) {
        match how {
            rustix::net::Shutdown::Write => self.shutdown_write(),
            // Reading stops by not reading: a TCP read shutdown would not tell the peer.
            rustix::net::Shutdown::Read => {}
            _ => TcpLink::shutdown(self),
        }
    }

    fn peer(&self) -> Result<Peer> {
        Ok(Peer::Remote(self.peer_addr()))
    }

    fn passes_descriptors(&self) -> bool {
        false
    }
}
