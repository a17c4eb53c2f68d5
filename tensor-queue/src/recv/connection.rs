//! A receiver's state for one sender's connection, and what each frame from it does: chunk and
//! event announcements, retirements, and messages, checked and ordered after the producer's work.
//!
//! A frame that cannot be trusted (it does not decode, breaks the protocol, or exceeds the
//! credits) closes the connection. A well-formed message that cannot be used here (it names a
//! chunk that could not be mapped, a GPU this process cannot see, a range outside its chunk) is
//! rejected alone: the sender hears why, `recv` reports it, and the connection goes on.

use std::collections::HashMap;
use std::sync::Arc;

use ipc_core::{Event, IpcEventHandle, Stream, Uuid};

use super::devices::Devices;
use super::imports::{Announced, import};
use super::peer::Peer;
use super::release::retry_stalled;
use super::remote::Remote;
use crate::clock::monotonic_ns;
use crate::error::{Error, Result};
use crate::fences::{Fences, Producer, producer};
use crate::links::link::{Link, Read};
use crate::memory::arena::Chunk;
use crate::route::Route;
use crate::tensor::Tensor;
use crate::wire::{Assembler, Frame, FrameError};

/// How long a receiver keeps a sender's unfinished message (the parts of a frame, the host bytes
/// of a message over TCP) while nothing more of it comes: then the connection is closed and the
/// loss reported (`Receiver::take_errors`, [`crate::Error::Unfinished`]). The memory a sender can
/// hold in a receiver is what it sent, never what it claimed: one frame's parts (at most
/// [`crate::wire::MAX_MESSAGE_BYTES`]), a TCP message's host bytes (at most
/// [`crate::wire::MAX_INLINE_BYTES`]) and one TCP record (grown as its bytes arrive), and no
/// longer than this without a new byte.
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
/// assert!(info.arrived_ns <= info.imported_ns && info.imported_ns <= info.decoded_ns);
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
    /// When `recv` finished decoding the message.
    pub decoded_ns: u64,
}

/// What reading a connection found.
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
    pub tensors: Vec<Tensor>,
    pub payload: Vec<u8>,
    pub info: MessageInfo,
    /// The producer's fences the message waits for: whether its producer failed.
    pub fences: Fences,
    /// Whether some are host words `recv` waits for on the CPU before delivering (host-route
    /// tensors; see `Receiver::must_park`).
    pub on_cpu: bool,
}

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
    /// Messages read and not yet covered by a credit: never more than the capacity.
    uncredited: u32,
    /// Messages taken since credits were last returned.
    taken: u32,
    /// The sequence number of the last message read.
    last_seq: u64,
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
            peer: Peer::new(link, retry_stalled),
            assembler: Assembler::default(),
            producer: None,
            chunks: HashMap::new(),
            refused: HashMap::new(),
            events: HashMap::new(),
            streams: Vec::new(),
            uncredited: 0,
            taken: 0,
            last_seq: 0,
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

    /// Why the connection ends with a message lost, if one was under way.
    pub fn lost(&self, why: &str) -> Option<Error> {
        // Over TCP the link also holds the piece of a packet still arriving: a sender killed
        // with part of one written lost a message too (issue 21). (Not counted for the idle
        // deadline: a piece read just now after a long quiet is no message idling.)
        let received = (self.unfinished() + self.peer.link.partial()) as u64;
        (received > 0).then(|| Error::Unfinished { received, why: why.into() })
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
        self.peer.close(self.last_seq, reason);
        self.peer.link.shutdown(rustix::net::Shutdown::Read);
    }

    pub fn pid(&self) -> u32 {
        self.peer.link.peer_pid()
    }

    /// Why tensor `index` of a message cannot be used here: the message is rejected alone.
    pub fn refusal(&self, index: usize, reason: String) -> Error {
        Error::Frame { pid: self.pid(), source: FrameError::OutOfBounds { index, reason } }
    }

    /// Counts a message as taken by `recv` (or rejected), returning credits in batches of half
    /// the capacity, which keeps a frame off most hand-offs.
    pub fn took(&mut self, capacity: u32) {
        self.taken += 1;
        if self.taken >= capacity.div_ceil(2) {
            self.peer.credit(self.taken);
            self.uncredited -= self.taken;
            self.taken = 0;
        }
    }

    /// Reads the next packet if one is waiting and does what it says. An error closes the
    /// connection.
    pub fn read(&mut self, buf: &mut [u8], devices: &Devices, capacity: u32) -> Result<Progress> {
        let held = self.assembler.held();
        let (read, fds_lost) = self.peer.link.try_recv(&mut self.assembler, buf)?;
        let (frame, mut fds) = match read {
            Read::Frame(frame, fds) => (frame, fds),
            Read::Nothing if self.assembler.held() > held => {
                self.last_packet = std::time::Instant::now();
                return Ok(Progress::Handled);
            }
            Read::Nothing => return Ok(Progress::Idle),
            Read::HungUp => return Ok(Progress::HungUp),
        };
        self.last_packet = std::time::Instant::now();
        let arrived_ns = monotonic_ns();
        let Some((instance, _)) = &self.producer else {
            let instance = self.peer.link.check_hello(frame)?.instance;
            let producer = producer(self.pid(), instance, matches!(self.flavor, Flavor::Local));
            producer.report_to(self.peer.link.liveness());
            self.producer = Some((instance, producer));
            return Ok(Progress::Greeted);
        };
        let instance = *instance;
        match (frame, &mut self.flavor) {
            (Frame::Bytes { data }, Flavor::Remote(remote)) => remote.bytes(data)?,
            (Frame::Communicator { id, unique_id, target }, Flavor::Remote(remote)) => {
                remote.join(devices, id, &unique_id, Uuid(target), Arc::downgrade(&self.peer))?;
            }
            (Frame::Chunk { .. } | Frame::Event { .. } | Frame::Retire { .. }, Flavor::Remote(_)) => {
                return Err(Error::Protocol("a sender on another host announced local memory".into()));
            }
            (Frame::Chunk { id, len, kind, device, legacy, .. }, Flavor::Local) => {
                let announced = Announced { id, len: len as usize, kind, device: Uuid(device), legacy, fd: fds.pop() };
                // A descriptor the kernel dropped (our table was full) makes the chunk unusable,
                // not the connection: the messages that use it are refused, and say why.
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
                        self.chunks.remove(&id);
                        self.refused.insert(id, error.to_string());
                    }
                }
            }
            (Frame::Event { id, handle }, Flavor::Local) => {
                let event = Event::import(&IpcEventHandle::from_bytes(&handle)?)?;
                self.events.insert(id, Arc::new(event));
            }
            (Frame::Retire { chunk }, Flavor::Local) => {
                self.chunks.remove(&chunk);
                self.refused.remove(&chunk);
            }
            (Frame::Message { seq, sent_ns, encoded_ns, tensors, payload }, flavor) => {
                let remote = matches!(flavor, Flavor::Remote(_));
                if self.uncredited >= capacity {
                    return Err(Error::Protocol(format!("more than the {capacity} messages its credits allow")));
                }
                self.uncredited += 1;
                self.last_seq = seq;
                let info = MessageInfo {
                    sender_pid: self.pid(),
                    connection: self.peer.connection,
                    seq,
                    sent_ns,
                    encoded_ns,
                    arrived_ns,
                    imported_ns: 0,
                    decoded_ns: 0,
                };
                let placed = if remote {
                    self.place_remote(devices, &tensors, payload, info)
                } else {
                    self.place(devices, &tensors, payload, info)
                };
                return Ok(Progress::Arrived(match placed {
                    Ok(ready) => Arrival::Ready(ready),
                    // Its sender has queued the message's NCCL sends already: refused alone, they
                    // would pair with the receives of the next message on those communicators
                    // (its bytes would be another message's, or the transfer would hang). Closing
                    // the connection aborts them on both sides.
                    Err(error) if tensors.iter().any(|d| d.route == Route::Nccl) => {
                        return Err(Error::Protocol(format!(
                            "a message with NCCL transfers could not be received, so its connection cannot go on: {error}"
                        )));
                    }
                    Err(error) => {
                        let reason = error.to_string();
                        self.peer.reject(seq, reason.clone());
                        self.took(capacity);
                        Arrival::Rejected { pid: self.pid(), connection: self.peer.connection, seq, reason }
                    }
                }));
            }
            (other, _) => return Err(Error::Protocol(format!("a sender sent {other:?}"))),
        }
        Ok(Progress::Handled)
    }
}
