//! A receiver's state for one sender's connection, and what each frame from it does: chunk and
//! event announcements, retirements, and messages, checked and ordered after the producer's work.
//!
//! A frame that cannot be trusted (it does not decode, breaks the protocol, or exceeds the
//! credits) closes the connection. A well-formed message that cannot be used here (it names a
//! chunk that could not be mapped, a GPU this process cannot see, a range outside its chunk) is
//! rejected alone: the sender hears why, `recv` reports it, and the connection goes on.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use ipc_core::{Event, IpcEventHandle, Stream, Uuid};

use super::devices::Devices;
use super::imports::{Announced, import};
use super::peer::Peer;
use super::protocol::{ConnectionProtocol, Incoming};
use super::release::{flush_later, retry_stalled};
use super::remote::Remote;
use crate::clock::monotonic_ns;
use crate::error::{Error, Result, Violation};
use crate::fences::{Fences, Producer, producer};
use crate::links::link::{self, Link, Read};
use crate::memory::arena::Chunk;
use crate::route::Route;
use crate::side_table::Received;
use crate::wire::{Assembler, Frame, FrameError, Hello, ToReceiver};

/// How long a receiver keeps a sender's unfinished message (the parts of a frame, the host bytes
/// of a message over TCP) while nothing more of it comes: then the connection is closed and the
/// loss reported (`Receiver::take_errors`, [`crate::Error::Unfinished`]). The memory a sender can
/// hold in a receiver is what it sent, never what it claimed: one frame's parts (at most
/// [`crate::MAX_MESSAGE_BYTES`]), a TCP message's host bytes (at most 4 GiB) and one TCP record
/// (grown as its bytes arrive), and no longer than this without a new byte.
pub const UNFINISHED_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

/// When and how a message arrived, on the machine's monotonic clock (nanoseconds). From a
/// sender on another host (a TCP channel), `sent_ns` and `encoded_ns` are on that host's clock
/// and `sender_pid` is the pid it gave.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{Receiver, Sender};
/// # let path = std::env::temp_dir().join(format!("doc-{}-message-info.sock", std::process::id()));
/// # let mut receiver = Receiver::<u32>::bind(&path)?;
/// # let sender = Sender::<u32>::connect(&path)?;
/// sender.send(&1)?;
/// let (_, info) = receiver.recv_with_info(None)?;
/// // One clock for every process of the machine: the stages are in order, whoever sent.
/// assert!(info.sent_ns <= info.encoded_ns && info.encoded_ns <= info.arrived_ns);
/// assert!(info.arrived_ns <= info.imported_ns && info.imported_ns <= info.taken_ns);
/// assert!(info.taken_ns <= info.decoded_ns);
/// println!("in the socket: {} ns", info.arrived_ns - info.encoded_ns);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MessageInfo {
    /// The sender's process id.
    pub sender_pid: u32,
    /// This process's number for the sender's connection, unique for the life of the process:
    /// it tells apart several senders of one process (which share `sender_pid` and each number
    /// their messages from 1), and a sender that connected again. (`connection`, `seq`) names
    /// one message; so it does in [`crate::Error::Rejected`] and [`crate::Error::ProducerFailed`].
    pub connection: u64,
    /// Sequence number on its connection.
    pub seq: u64,
    /// When the sender called `send`.
    pub sent_ns: u64,
    /// When the sender finished encoding (before the socket write).
    pub encoded_ns: u64,
    /// When the receiver read the frame from the socket.
    pub arrived_ns: u64,
    /// When its tensors were mapped, validated and ordered on the receiver's stream.
    pub imported_ns: u64,
    /// When `recv` took it to decode: after any wait for its data to be ordered (a host-route
    /// tensor's copy, an NCCL receive being queued by its worker).
    pub taken_ns: u64,
    /// When `recv` finished decoding the message.
    pub decoded_ns: u64,
}

/// What reading a connection found.
#[expect(
    clippy::large_enum_variant,
    reason = "a message's table travels in `Ready` by value: moved once per read, not boxed per message"
)]
pub(crate) enum Progress {
    /// Nothing whole was waiting.
    Idle,
    /// A frame was read and handled (an announcement, a part of a longer frame).
    Handled,
    /// The sender's `Hello`: it has joined.
    Greeted,
    /// A message.
    Arrived(Arrival),
    /// The sender hung up.
    HungUp,
}

/// A message read from a connection, for `recv`.
pub(crate) enum Arrival {
    /// Validated and ordered; ready to decode.
    Ready(Ready),
    /// Refused: the sender was told, and `recv` reports it.
    Rejected { pid: u32, connection: u64, seq: u64, reason: String },
}

/// A validated message waiting for `recv`.
pub(crate) struct Ready {
    pub peer: Arc<Peer>,
    /// Its tensors, made when `recv` decodes the payload.
    pub tensors: Received,
    pub payload: Vec<u8>,
    pub info: MessageInfo,
    /// The producer's fences the message waits for: whether its producer failed.
    pub fences: Fences,
    /// Whether some are host words `recv` waits for on the CPU before delivering (host-route
    /// tensors; see `Receiver::must_park`).
    pub on_cpu: bool,
}

/// A frame read (with its descriptors, and the error of descriptors the kernel dropped), or what
/// reading found instead.
type Next<F> = std::result::Result<(F, Vec<OwnedFd>, Option<Error>), Progress>;

/// A sender on this machine, or on another host (its link says which).
pub(crate) enum Flavor {
    /// Chunks and events are announced and mapped.
    Local,
    /// Host bytes over the link and NCCL communicators (see `remote.rs`).
    Remote(Remote),
}

/// The receiver's state for one connection.
pub(crate) struct Connected {
    pub peer: Arc<Peer>,
    assembler: Assembler,
    /// The sender's process, known once its `Hello` came.
    pub(crate) producer: Option<(u64, Arc<Producer>)>,
    /// Chunks by the sender's id; those that could not be mapped, with why.
    pub(crate) chunks: HashMap<u64, Arc<Chunk>>,
    pub(super) refused: HashMap<u64, String>,
    pub(super) events: HashMap<u32, Arc<Event>>,
    /// This connection's stream per device: waits for one sender's work never hold up another's.
    pub(super) streams: Vec<(Uuid, Arc<Stream>)>,
    /// What each frame may say at this point: credits, announcements (see `protocol.rs`).
    protocol: ConnectionProtocol,
    /// For a sender on another host: its bytes and communicators.
    pub(super) flavor: Flavor,
    /// When a packet last came: an unfinished message idle past `UNFINISHED_IDLE` is given up.
    last_packet: std::time::Instant,
}

impl Drop for Connected {
    fn drop(&mut self) {
        if let Flavor::Remote(remote) = &mut self.flavor {
            remote.retire(self.peer.clone());
        }
    }
}

impl Connected {
    pub fn new(link: Link) -> Connected {
        let flavor = if link.remote { Flavor::Remote(Remote::default()) } else { Flavor::Local };
        Connected {
            peer: Peer::new(link, retry_stalled, flush_later),
            assembler: Assembler::default(),
            producer: None,
            chunks: HashMap::new(),
            refused: HashMap::new(),
            events: HashMap::new(),
            streams: Vec::new(),
            protocol: ConnectionProtocol::new(matches!(flavor, Flavor::Remote(_))),
            flavor,
            last_packet: std::time::Instant::now(),
        }
    }

    /// The bytes of an unfinished message held for this sender (0: none is under way).
    pub fn unfinished(&self) -> usize {
        self.assembler.held()
            + match &self.flavor {
                Flavor::Remote(remote) => remote.unfinished(),
                Flavor::Local => 0,
            }
    }

    /// When the unfinished message held for this sender is given up if nothing more comes.
    pub fn unfinished_deadline(&self) -> Option<std::time::Instant> {
        (self.unfinished() > 0).then(|| self.last_packet + UNFINISHED_IDLE)
    }

    /// Why the connection ends with messages lost: one under way, or (a sender on this machine)
    /// messages its `send` accepted that it never wrote ([`Error::Unsent`]).
    pub fn lost(&self, why: &str) -> Option<Error> {
        // Over TCP the link also holds the piece of a packet still arriving: a sender killed
        // with part of one written lost a message too (issue 21). (Not counted for the idle
        // deadline: a piece read just now after a long quiet is no message idling.)
        let received = (self.unfinished() + self.peer.link.partial()) as u64;
        if received > 0 {
            return Some(Error::Unfinished { received, why: why.into() });
        }
        let accepted = self.peer.link.peer_accepted()?;
        let count = accepted.checked_sub(self.protocol.read_up_to()).filter(|&count| count > 0)?;
        Some(Error::Unsent { count, why: why.into() })
    }

    /// The receiver is being dropped: the NCCL workers of a sender on another host give up now
    /// (see `remote.rs`).
    pub fn abandon(&mut self) {
        if let Flavor::Remote(remote) = &mut self.flavor {
            remote.abandon();
        }
    }

    /// Stops reading this connection: the sender hears why, and that messages after the last one
    /// read are its own again. The sending side stays open for the releases of what is held.
    pub fn close(&self, reason: String) {
        self.peer.close(self.protocol.read_up_to(), reason);
        self.peer.link.shutdown(rustix::net::Shutdown::Read);
    }

    pub fn pid(&self) -> u32 {
        self.peer.link.peer_pid()
    }

    /// Why storage record `index` of a message cannot be used here: the message is rejected alone.
    pub fn refusal(&self, index: usize, reason: String) -> Error {
        Error::Frame { pid: self.pid(), source: FrameError::Storage { index, reason } }
    }

    /// Counts a message as taken by `recv` (or rejected), returning credits in batches of half
    /// the capacity, which keeps a frame off most hand-offs.
    pub fn took(&mut self, capacity: u32) {
        if let Some(count) = self.protocol.took(capacity) {
            self.peer.credit(count);
        }
    }

    /// Reads what has come of a bulk run of host bytes (`left` bytes not read yet) from a sender
    /// on another host, between two frames. An error closes the connection.
    fn read_bulk(&mut self, left: u64) -> Result<Progress> {
        let Flavor::Remote(remote) = &mut self.flavor else {
            // A link to this machine carries no runs of bytes: its reads never report one.
            return Err(Error::internal("a run of bytes from a sender on this machine"));
        };
        if self.assembler.held() > 0 || self.producer.is_none() {
            return Err(Violation::BulkOutOfPlace.into());
        }
        match remote.bulk(left, &self.peer.link) {
            Ok(0) if left > 0 => return Ok(Progress::Idle),
            Ok(_) => {}
            // A sender gone in the middle of the run lost its message: a hang-up, which says so.
            Err(Error::Disconnected) => return Ok(Progress::HungUp),
            Err(error) => return Err(error),
        }
        self.last_packet = std::time::Instant::now();
        Ok(Progress::Handled)
    }

    /// Refuses message `seq` alone: the sender hears why, then (if it `leased` the message: a
    /// sender on this machine leases a message with tensors until released) the release of its
    /// lease, so that `wait_released` implies `take_rejected` knows.
    fn reject(&mut self, seq: u64, reason: String, leased: bool, capacity: u32) -> Arrival {
        self.peer.reject(seq, reason.clone());
        if leased {
            self.peer.release([seq]);
        }
        self.took(capacity);
        Arrival::Rejected { pid: self.pid(), connection: self.peer.connection, seq, reason }
    }

    /// Reads the next packet if one is waiting and does what it says. An error closes the
    /// connection.
    pub fn read(&mut self, buf: &mut [u8], devices: &Devices, capacity: u32) -> Result<Progress> {
        let Some((instance, _)) = &self.producer else {
            // The first frame is the sender's `Hello`; any other is a decode error.
            let hello = match self.next::<Hello>(buf)? {
                Ok((hello, ..)) => hello,
                Err(progress) => return Ok(progress),
            };
            let instance = self.peer.link.check_hello(hello)?.instance;
            let producer = producer(self.pid(), instance, matches!(self.flavor, Flavor::Local));
            producer.report_to(self.peer.link.liveness());
            self.producer = Some((instance, producer));
            return Ok(Progress::Greeted);
        };
        let instance = *instance;
        let (frame, mut fds, fds_lost) = match self.next::<ToReceiver>(buf)? {
            Ok(read) => read,
            Err(progress) => return Ok(progress),
        };
        let arrived_ns = monotonic_ns();
        tracing::trace!(pid = self.pid(), frame = %format!("{frame:?}").chars().take(60).collect::<String>(), fds = fds.len(), "recv: frame");
        let frame = match self.protocol.on_frame(frame, capacity)? {
            Incoming::Act(frame) => frame,
            Incoming::Retired(chunk) => {
                self.chunks.remove(&chunk);
                self.refused.remove(&chunk);
                return Ok(Progress::Handled);
            }
            Incoming::Refused { seq, index, reason } => {
                let reason = self.refusal(index, reason).to_string();
                return Ok(Progress::Arrived(self.reject(seq, reason, true, capacity)));
            }
        };
        match (frame, &mut self.flavor) {
            (ToReceiver::Bytes { .. }, Flavor::Remote(_)) => {
                // Host bytes come as a bulk run before their message (`read_bulk`), never framed.
                return Err(Violation::FramedBytes.into());
            }
            (ToReceiver::Communicator { id, unique_id, target }, Flavor::Remote(remote)) => {
                remote.join(devices, id, &unique_id, Uuid(target), Arc::downgrade(&self.peer))?;
            }
            (ToReceiver::Chunk { .. } | ToReceiver::Event { .. } | ToReceiver::Retire { .. }, Flavor::Remote(_)) => {
                return Err(Violation::LocalFromRemote.into());
            }
            (ToReceiver::Bytes { .. } | ToReceiver::Communicator { .. }, Flavor::Local) => {
                return Err(Violation::RemoteFromLocal.into());
            }
            (ToReceiver::Chunk { id, len, kind, device, legacy, .. }, Flavor::Local) => {
                let announced = Announced { id, len: len as usize, kind, device: Uuid(device), legacy, fd: fds.pop() };
                // A descriptor the kernel dropped (our table was full) makes the chunk unusable,
                // not the connection: the messages that use it are refused, and say why, until
                // the sender, told of the loss, announces the chunk again.
                let imported = match fds_lost {
                    Some(lost) => Err(lost),
                    None => import(self.pid(), instance, announced, |uuid| devices.context(uuid)),
                };
                match imported {
                    Ok(chunk) => {
                        self.refused.remove(&id);
                        self.chunks.insert(id, chunk);
                    }
                    Err(error) => {
                        tracing::warn!(pid = self.pid(), chunk = id, %error, "could not map a chunk");
                        if matches!(error, Error::Core(ipc_core::Error::DescriptorTableFull { .. })) {
                            self.peer.chunk_lost(id);
                        }
                        self.chunks.remove(&id);
                        self.refused.insert(id, error.to_string());
                    }
                }
            }
            (ToReceiver::Event { id, handle }, Flavor::Local) => {
                let event = Event::import(&IpcEventHandle::from_bytes(&handle)?)?;
                self.events.insert(id, Arc::new(event));
            }
            // The protocol hands retirements back as `Incoming::Retired`.
            (ToReceiver::Retire { .. }, Flavor::Local) => {}
            (ToReceiver::Message { seq, sent_ns, encoded_ns, tensors, payload }, flavor) => {
                let remote = matches!(flavor, Flavor::Remote(_));
                let info = MessageInfo {
                    sender_pid: self.pid(),
                    connection: self.peer.connection,
                    seq,
                    sent_ns,
                    encoded_ns,
                    arrived_ns,
                    imported_ns: 0,
                    taken_ns: 0,
                    decoded_ns: 0,
                };
                let (nccl, leased) = (tensors.uses(Route::Nccl), !remote && !tensors.is_empty());
                let placed = self.place(devices, tensors, payload, info);
                return Ok(Progress::Arrived(match placed {
                    Ok(ready) => Arrival::Ready(ready),
                    // Its sender has queued the message's NCCL sends already: refused alone, they
                    // would pair with the receives of the next message on those communicators
                    // (its bytes would be another message's, or the transfer would hang). Closing
                    // the connection aborts them on both sides.
                    Err(error) if nccl => {
                        return Err(Error::NcclMessageLost { seq, cause: Box::new(error) });
                    }
                    Err(error) => self.reject(seq, error.to_string(), leased, capacity),
                }));
            }
        }
        Ok(Progress::Handled)
    }

    /// Reads the next packet if one is waiting: the frame it completes (with its descriptors, and
    /// the error of descriptors the kernel dropped), or what reading it found instead.
    fn next<F: Frame>(&mut self, buf: &mut [u8]) -> Result<Next<F>> {
        let held = self.assembler.held();
        let (read, fds_lost) = match self.peer.link.try_recv_or_bulk(&mut self.assembler, buf)? {
            link::Incoming::Read(read, lost) => (read, lost),
            link::Incoming::Bulk(left) => return self.read_bulk(left).map(Err),
        };
        let (frame, fds) = match read {
            Read::Frame(frame, fds) => (frame, fds),
            Read::Nothing if self.assembler.held() > held => {
                self.last_packet = std::time::Instant::now();
                return Ok(Err(Progress::Handled));
            }
            Read::Nothing => return Ok(Err(Progress::Idle)),
            Read::HungUp => return Ok(Err(Progress::HungUp)),
        };
        self.last_packet = std::time::Instant::now();
        Ok(Ok((frame, fds, fds_lost)))
    }
}
