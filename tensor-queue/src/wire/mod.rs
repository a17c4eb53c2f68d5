//! Frames on the socket: versioned, little-endian, and validated before anything uses them.
//!
//! A frame is a 12-byte header (magic, version, kind, body length) and a body. A frame of at most
//! [`MAX_PACKET`] bytes travels as one `SOCK_SEQPACKET` message; a longer one (a message with many
//! tensors or a large payload) is cut into parts ([`packets`]), each a packet of its own, which
//! the peer joins again ([`Assembler`]) up to [`MAX_MESSAGE_BYTES`].
//!
//! The frames are split by direction, each with its encode and decode together: the one
//! [`Hello`] each way first (`hello.rs`, with the sender's [`Answer`]), then what a sender sends
//! ([`ToReceiver`], `to_receiver.rs`) and what a receiver sends ([`ToSender`], `to_sender.rs`).
//! Each side decodes only the frames that travel towards it, so a frame in the wrong direction
//! is a decode error ([`FrameError::WrongDirection`]). Decoding checks everything that can be
//! checked without the connection's state: sizes, counts, dtypes, element counts, alignment, and
//! that every view lies inside its storage. The receiver then checks each descriptor against the
//! chunk it names, and the protocol's state machines (`send/protocol.rs`, `recv/protocol.rs`)
//! what a frame may say at that point.

mod descriptor;
mod hello;
mod routing;
mod to_receiver;
mod to_sender;

pub use hello::{Answer, Hello};
pub use to_receiver::ToReceiver;
pub use to_sender::ToSender;

pub use descriptor::{ChunkKind, Descriptors, Fence, MAX_RUN_TENSORS, Source, StorageDesc, TensorDesc};
use descriptor::{decode_table, encode_table};

/// Frame magic.
///
/// ```
/// use tensor_queue::testing::wire::{Frame, MAGIC, ToSender};
/// let bytes = ToSender::Credit { count: 1 }.encode();
/// assert_eq!(bytes[..4], MAGIC); // every frame and every part starts with it
/// ```
pub const MAGIC: [u8; 4] = *b"TQF1";
/// Protocol version; a peer with another version is refused at the handshake.
///
/// 7: a message without tensors is never released (its sender leases nothing), a refused
/// message's lease comes back by its release, and a release of anything else is a violation.
/// 8: a local link's per-message frames go through shared-memory rings ([`LinkFrame`]).
/// 9: a message's table describes a run of like tensors of one record in one row
/// ([`MAX_RUN_TENSORS`]).
///
/// ```
/// use tensor_queue::FrameError;
/// use tensor_queue::testing::wire::{Frame, ToSender, VERSION};
/// let mut bytes = ToSender::Credit { count: 1 }.encode();
/// assert_eq!(bytes[4..6], VERSION.to_le_bytes());
/// bytes[4..6].copy_from_slice(&(VERSION + 1).to_le_bytes()); // as a newer build would send it
/// assert_eq!(ToSender::decode(&bytes), Err(FrameError::Version(VERSION + 1)));
/// ```
pub const VERSION: u16 = 9;

/// The largest packet: one SEQPACKET message must fit the socket's send buffer.
///
/// ```
/// use tensor_queue::testing::wire::{Frame, MAX_PACKET, ToReceiver, packets};
/// let message = |payload: usize| {
///     ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: Default::default(), payload: vec![0; payload] }.encode()
/// };
/// assert_eq!(packets(&message(1000)).len(), 1);
/// assert!(packets(&message(MAX_PACKET)).len() > 1, "longer than a packet: sent in parts");
/// ```
pub const MAX_PACKET: usize = 64 << 10;
/// The largest frame, after its parts are joined: a message's encoded descriptors and payload
/// (about 100 bytes per tensor plus the serde bytes). `send` refuses a larger message with
/// [`Error::TooLarge`](crate::Error::TooLarge); bulk data belongs in tensors.
///
/// ```
/// use tensor_queue::testing::wire::MAX_MESSAGE_BYTES;
/// // About 100 bytes per tensor: a message of a million tensors still fits, with room for its fields.
/// assert!(1_000_000 * 100 < MAX_MESSAGE_BYTES);
/// ```
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;
/// The most message ids in one release frame (a receiver sends more as several frames).
///
/// ```
/// use tensor_queue::FrameError;
/// use tensor_queue::testing::wire::{Frame, MAX_RELEASES, ToSender};
/// let too_many = ToSender::Release { messages: vec![1; MAX_RELEASES + 1] }.encode();
/// assert!(matches!(ToSender::decode(&too_many), Err(FrameError::TooMany { what: "releases", .. })));
/// ```
pub const MAX_RELEASES: usize = 4096;
/// The longest reason text in a `Rejected` or `Close` frame.
///
/// ```
/// # fn main() -> Result<(), tensor_queue::FrameError> {
/// use tensor_queue::testing::wire::{Frame, MAX_REASON, ToSender};
/// let long = ToSender::Rejected { seq: 1, reason: "x".repeat(2 * MAX_REASON) };
/// let ToSender::Rejected { reason, .. } = ToSender::decode(&long.encode())? else { unreachable!() };
/// assert_eq!(reason.len(), MAX_REASON); // cut when encoded, so that it always decodes
/// # Ok(()) }
/// ```
pub const MAX_REASON: usize = 4096;
/// Size of an encoded legacy IPC handle.
///
/// ```
/// use tensor_queue::testing::wire::{ChunkKind, Frame, LEGACY_HANDLE_LEN, ToReceiver};
/// let announce = |handle: Vec<u8>| {
///     let kind = ChunkKind::Legacy;
///     let chunk = ToReceiver::Chunk { id: 1, len: 4096, kind, device: [0; 16], legacy: Some(handle), writable: false };
///     ToReceiver::decode(&chunk.encode())
/// };
/// assert!(announce(vec![0; LEGACY_HANDLE_LEN]).is_ok());
/// assert!(announce(vec![0; 8]).is_err(), "a handle of another size");
/// ```
pub const LEGACY_HANDLE_LEN: usize = ipc_core::IpcMemHandle::ENCODED_LEN;
const HEADER_LEN: usize = 12;

/// A frame that cannot be used.
///
/// ```
/// use tensor_queue::FrameError;
/// use tensor_queue::testing::wire::{Frame, ToReceiver};
/// assert!(matches!(ToReceiver::decode(b"GET / HTTP/1.1\r\n"), Err(FrameError::BadMagic(_))));
/// assert!(matches!(ToReceiver::decode(&[]), Err(FrameError::Truncated { .. })));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than a field needs.
    #[error("the frame ends early (needed {needed} more bytes at offset {at})")]
    Truncated {
        /// Where the field starts.
        at: usize,
        /// Bytes missing.
        needed: usize,
    },
    /// Bytes after the last field.
    #[error("{0} bytes after the end of the frame")]
    Trailing(usize),
    /// Not a frame of this protocol.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// Another protocol version.
    #[error("protocol version {0}, this build speaks {VERSION}")]
    Version(u16),
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u16),
    /// A frame of this protocol that does not travel this way: one a receiver sends, read by a
    /// receiver (or the other way round), or a second `Hello`.
    #[error("a frame of kind {kind} does not travel this way")]
    WrongDirection {
        /// The frame's kind.
        kind: u16,
    },
    /// A first frame that is not a `Hello` (nor, from a receiver, the `Close` of a refusal).
    #[error("the first frame was of kind {kind}, not a Hello")]
    NotHello {
        /// The frame's kind.
        kind: u16,
    },
    /// The header's length disagrees with the frame.
    #[error("the header says {said} body bytes, the frame has {has}")]
    Length {
        /// Length in the header.
        said: usize,
        /// Actual length.
        has: usize,
    },
    /// A count over its limit.
    #[error("{count} {what} in one frame; at most {max}")]
    TooMany {
        /// What was counted.
        what: &'static str,
        /// How many.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A dtype code this build does not know.
    #[error("unknown dtype code {0}")]
    BadDType(u8),
    /// A tensor view reaching outside its storage, or naming a storage record the message does
    /// not have.
    #[error("tensor {index}: {reason}")]
    OutOfBounds {
        /// The tensor's position in the message.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A storage record of a message that cannot be used: its source or fence makes no sense for
    /// its route, it overlaps another record, or (found by the receiver) it lies outside its
    /// chunk or names what the connection does not have.
    #[error("storage record {index}: {reason}")]
    Storage {
        /// The record's position in the message's table.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A field with a value that makes no sense.
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// A frame's parts add up to more than [`MAX_MESSAGE_BYTES`], or a part came out of order.
    #[error("a frame of parts over {MAX_MESSAGE_BYTES} bytes, or a part out of order")]
    Parts,
}

/// A frame type one side writes or reads: its bytes, and decoding (and validating) them. Each
/// direction decodes only its own kinds ([`ToReceiver`], [`ToSender`]; a [`Hello`] or
/// [`Answer`] first), so a frame that does not travel this way is a decode error.
pub trait Frame: Sized {
    /// The frame's bytes: the header, then the body.
    fn encode(&self) -> Vec<u8>;
    /// Decodes and validates one frame. Never panics, whatever the bytes.
    fn decode(bytes: &[u8]) -> Result<Self, FrameError>;
}

/// The most bytes of host tensors one message may carry over TCP (as [`ToReceiver::Bytes`]).
pub const MAX_INLINE_BYTES: u64 = 4 << 30;
const _: () = assert!(MAX_INLINE_BYTES == crate::route::MAX_INLINE_GPU_UP_TO, "an inline threshold fits a bulk run");

/// The largest [`ToReceiver::Bytes`] a sender writes: the receiver joins its packets in memory.
pub const BYTES_FRAME: usize = 4 << 20;

const KIND_HELLO: u16 = 1;
const KIND_CHUNK: u16 = 2;
const KIND_EVENT: u16 = 3;
const KIND_MESSAGE: u16 = 4;
const KIND_RELEASE: u16 = 5;
const KIND_CREDIT: u16 = 6;
const KIND_RETIRE: u16 = 7;
const KIND_REJECTED: u16 = 8;
const KIND_CLOSE: u16 = 9;
/// A part of a frame longer than [`MAX_PACKET`]: a byte saying whether it is the last, then bytes.
const KIND_PART: u16 = 10;
const KIND_BYTES: u16 = 11;
const KIND_COMMUNICATOR: u16 = 12;
const KIND_RINGS: u16 = 13;
const KIND_RINGS_ON: u16 = 14;
const KIND_RINGS_OFF: u16 = 15;
const KIND_ON_SOCKET: u16 = 16;
const KIND_CHUNK_LOST: u16 = 17;

/// The frames of the link itself (`links/link.rs`), never seen above it: the switch of a local
/// link's per-message frames to shared-memory rings, and the marker that keeps the ring the one
/// ordered path. Header-only frames; the descriptors they need travel beside them.
///
/// ```
/// use tensor_queue::testing::wire::{Frame, LinkFrame, ToReceiver};
/// let marker = LinkFrame::OnSocket.encode();
/// assert_eq!(marker.len(), 12, "a header alone");
/// assert_eq!(LinkFrame::decode(&marker), Ok(LinkFrame::OnSocket));
/// assert!(LinkFrame::decode(&ToReceiver::Retire { chunk: 1 }.encode()).is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkFrame {
    /// From a receiver, after its `Hello`, on the socket, with four descriptors: the ring the
    /// sender writes, the ring it reads, the eventfd it rings when the receiver sleeps, and the
    /// one the receiver rings when the sender sleeps (all made by the receiver, so descriptors
    /// cross once, at the greeting). The sender answers `RingsOn` or `RingsOff`.
    Rings,
    /// On the socket, without descriptors: "my frames after this one come through my ring". A
    /// receiver sends its own once it read the sender's.
    RingsOn,
    /// From a sender that cannot use the rings: both directions stay on the socket.
    RingsOff,
    /// A ring record: the next frame is on the socket (it carries descriptors, or is longer than
    /// a ring record, or is one the socket keeps). Read it before the ring's next record.
    OnSocket,
}

impl LinkFrame {
    /// The link frame in `packet`, if its header says it is one (`None` for every other frame).
    pub(crate) fn peek(packet: &[u8]) -> Option<Result<LinkFrame, FrameError>> {
        let kind = u16::from_le_bytes(packet.get(6..8)?.try_into().ok()?);
        (packet[..4] == MAGIC && (KIND_RINGS..=KIND_ON_SOCKET).contains(&kind)).then(|| LinkFrame::decode(packet))
    }
}

impl Frame for LinkFrame {
    fn encode(&self) -> Vec<u8> {
        end(begin(match self {
            LinkFrame::Rings => KIND_RINGS,
            LinkFrame::RingsOn => KIND_RINGS_ON,
            LinkFrame::RingsOff => KIND_RINGS_OFF,
            LinkFrame::OnSocket => KIND_ON_SOCKET,
        }))
    }

    fn decode(bytes: &[u8]) -> Result<LinkFrame, FrameError> {
        let (kind, r) = open(bytes)?;
        let frame = match kind {
            KIND_RINGS => LinkFrame::Rings,
            KIND_RINGS_ON => LinkFrame::RingsOn,
            KIND_RINGS_OFF => LinkFrame::RingsOff,
            KIND_ON_SOCKET => LinkFrame::OnSocket,
            other => return Err(other_kind(other)),
        };
        r.finish()?;
        Ok(frame)
    }
}

/// Whether an encoded frame may travel as a ring record: not one the socket keeps (the
/// greeting, announcements, the closing, TCP's bytes and communicators, parts).
pub(crate) fn ring_eligible(encoded: &[u8]) -> bool {
    let kind = encoded.get(6..8).map_or(0, |kind| u16::from_le_bytes([kind[0], kind[1]]));
    matches!(kind, KIND_MESSAGE | KIND_RELEASE | KIND_CREDIT | KIND_RETIRE | KIND_REJECTED | KIND_CHUNK_LOST)
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }
    /// A reason text, cut to [`MAX_REASON`] bytes at a character boundary.
    fn text(&mut self, v: &str) {
        let mut end = v.len().min(MAX_REASON);
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.bytes(&v.as_bytes()[..end]);
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        let rest = self.bytes.len() - self.at;
        if n > rest {
            return Err(FrameError::Truncated { at: self.at, needed: n - rest });
        }
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A count, checked against its limit before anything is allocated for it.
    fn count(&mut self, what: &'static str, max: usize) -> Result<usize, FrameError> {
        let count = self.u32()? as usize;
        if count > max {
            return Err(FrameError::TooMany { what, count, max });
        }
        Ok(count)
    }
    fn text(&mut self) -> Result<String, FrameError> {
        let len = self.count("reason bytes", MAX_REASON)?;
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| FrameError::Invalid("reason text"))
    }
    /// The length of the frame's body (what follows the header).
    fn body_len(&self) -> usize {
        self.bytes.len() - HEADER_LEN
    }
    fn finish(&self) -> Result<(), FrameError> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            extra => Err(FrameError::Trailing(extra)),
        }
    }
}

/// A writer of a frame of `kind`, its header written (the body length is patched by [`end`]).
fn begin(kind: u16) -> Writer {
    let mut w = Writer(Vec::with_capacity(64));
    w.bytes(&MAGIC);
    w.u16(VERSION);
    w.u16(kind);
    w.u32(0); // body length, patched by `end`
    w
}

/// The frame's bytes, its body length patched in.
fn end(mut w: Writer) -> Vec<u8> {
    let body = (w.0.len() - HEADER_LEN) as u32;
    w.0[8..12].copy_from_slice(&body.to_le_bytes());
    w.0
}

/// Checks a frame's header (size, magic, version, length): its kind, and a reader at its body.
fn open(bytes: &[u8]) -> Result<(u16, Reader<'_>), FrameError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(FrameError::TooMany { what: "bytes", count: bytes.len(), max: MAX_MESSAGE_BYTES });
    }
    let mut r = Reader { bytes, at: 0 };
    let magic = r.array::<4>()?;
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = r.u16()?;
    if version != VERSION {
        return Err(FrameError::Version(version));
    }
    let kind = r.u16()?;
    let body = r.u32()? as usize;
    if body != bytes.len() - HEADER_LEN {
        return Err(FrameError::Length { said: body, has: bytes.len() - HEADER_LEN });
    }
    Ok((kind, r))
}

/// The error for a frame of `kind` where another direction's are read: a kind of this protocol
/// that does not travel this way, or one this build does not know.
fn other_kind(kind: u16) -> FrameError {
    match kind {
        KIND_HELLO..=KIND_CLOSE | KIND_BYTES | KIND_COMMUNICATOR | KIND_RINGS..=KIND_CHUNK_LOST => {
            FrameError::WrongDirection { kind }
        }
        other => FrameError::UnknownKind(other),
    }
}

fn decode_bool(r: &mut Reader<'_>, what: &'static str) -> Result<bool, FrameError> {
    match r.u8()? {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(FrameError::Invalid(what)),
    }
}

/// The packets that carry `frame` (its encoded bytes): itself if it fits one, else parts.
///
/// ```
/// use tensor_queue::testing::wire::{Frame, MAX_PACKET, ToReceiver, ToSender, packets};
/// let payload = vec![7; 200_000];
/// let bytes = ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: Default::default(), payload }.encode();
/// let parts = packets(&bytes);
/// assert!(parts.len() > 1 && parts.iter().all(|part| part.len() <= MAX_PACKET));
/// assert_eq!(packets(&ToSender::Credit { count: 1 }.encode()).len(), 1); // a short frame goes whole
/// ```
pub fn packets(frame: &[u8]) -> Vec<std::borrow::Cow<'_, [u8]>> {
    use std::borrow::Cow;
    if frame.len() <= MAX_PACKET {
        return vec![Cow::Borrowed(frame)];
    }
    let room = MAX_PACKET - HEADER_LEN - 1;
    let count = frame.len().div_ceil(room);
    frame
        .chunks(room)
        .enumerate()
        .map(|(i, piece)| {
            let mut w = Writer(Vec::with_capacity(HEADER_LEN + 1 + piece.len()));
            w.bytes(&MAGIC);
            w.u16(VERSION);
            w.u16(KIND_PART);
            w.u32(1 + piece.len() as u32);
            w.u8(u8::from(i + 1 == count));
            w.bytes(piece);
            Cow::Owned(w.0)
        })
        .collect()
}

/// Joins the packets of one connection into frames.
///
/// ```
/// # fn main() -> Result<(), tensor_queue::FrameError> {
/// use tensor_queue::testing::wire::{Assembler, Frame, ToReceiver, packets};
/// let frame = ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: Default::default(), payload: vec![7; 200_000] };
/// let bytes = frame.encode();
/// let mut assembler = Assembler::default(); // one per connection
/// let mut joined = None;
/// for packet in packets(&bytes) {
///     joined = assembler.push(&packet, Vec::new())?; // as read from the socket, in order
/// }
/// assert_eq!(joined.map(|(frame, _fds)| frame), Some(frame));
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct Assembler {
    parts: Vec<u8>,
    /// Descriptors that came with the first part.
    fds: Vec<std::os::fd::OwnedFd>,
}

impl Assembler {
    /// Whether a frame's parts have begun and not ended.
    ///
    /// ```
    /// # fn main() -> Result<(), tensor_queue::FrameError> {
    /// use tensor_queue::testing::wire::{Assembler, Frame, ToReceiver, packets};
    /// let payload = vec![7; 200_000];
    /// let bytes = ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: Default::default(), payload }.encode();
    /// let mut assembler = Assembler::default();
    /// assert!(assembler.push::<ToReceiver>(&packets(&bytes)[0], Vec::new())?.is_none());
    /// assert!(assembler.is_joining()); // the rest of the frame is still to come
    /// # Ok(()) }
    /// ```
    pub fn is_joining(&self) -> bool {
        !self.parts.is_empty()
    }

    /// The bytes of the unfinished frame held so far (what arrived, never what was claimed).
    pub fn held(&self) -> usize {
        self.parts.len()
    }

    /// Takes one packet (and the descriptors that came with it): the frame it completes, if any.
    ///
    /// ```
    /// # fn main() -> Result<(), tensor_queue::FrameError> {
    /// use tensor_queue::FrameError;
    /// use tensor_queue::testing::wire::{Assembler, Frame, ToReceiver, ToSender, packets};
    /// let payload = vec![7; 200_000];
    /// let bytes = ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: Default::default(), payload }.encode();
    /// let mut assembler = Assembler::default();
    /// let credit = ToSender::Credit { count: 1 }.encode();
    /// assert_eq!(assembler.push(&credit, Vec::new())?.map(|(frame, _)| frame), Some(ToSender::Credit { count: 1 }));
    /// assembler.push::<ToReceiver>(&packets(&bytes)[0], Vec::new())?;
    /// // A whole frame in the middle of another's parts is a broken peer.
    /// assert_eq!(assembler.push::<ToSender>(&credit, Vec::new()).err(), Some(FrameError::Parts));
    /// # Ok(()) }
    /// ```
    pub fn push<F: Frame>(
        &mut self,
        packet: &[u8],
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<Option<(F, Vec<std::os::fd::OwnedFd>)>, FrameError> {
        let is_part = packet.len() > HEADER_LEN + 1
            && packet[..4] == MAGIC
            && packet[4..6] == VERSION.to_le_bytes()
            && packet[6..8] == KIND_PART.to_le_bytes();
        if !is_part {
            if !self.parts.is_empty() {
                return Err(FrameError::Parts);
            }
            return F::decode(packet).map(|frame| Some((frame, fds)));
        }
        let body = u32::from_le_bytes(packet[8..12].try_into().unwrap_or_default()) as usize;
        if body != packet.len() - HEADER_LEN {
            return Err(FrameError::Length { said: body, has: packet.len() - HEADER_LEN });
        }
        if self.parts.len() + packet.len() > MAX_MESSAGE_BYTES {
            return Err(FrameError::Parts);
        }
        if self.parts.is_empty() {
            self.fds = fds;
        } else if !fds.is_empty() {
            return Err(FrameError::Invalid("descriptors on a later part"));
        }
        self.parts.extend_from_slice(&packet[HEADER_LEN + 1..]);
        if packet[HEADER_LEN] == 0 {
            return Ok(None);
        }
        let whole = std::mem::take(&mut self.parts);
        let fds = std::mem::take(&mut self.fds);
        if whole.len() <= MAX_PACKET {
            return Err(FrameError::Invalid("parts of a frame that fits one packet"));
        }
        F::decode(&whole).map(|frame| Some((frame, fds)))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::route::{DeviceReach, Landing, LinkReach, PeerMode, Reach, Routing, Strictness};
    use crate::tensor::dtype::DType;
    use ipc_core::Uuid;

    /// A message of one staged tensor of `shape` and `strides` at `view_offset` in a 48-byte copy.
    fn staged(shape: &[u64], strides: &[i64], view_offset: u64) -> ToReceiver {
        let mut tensors = Descriptors::default();
        let storage = tensors.push_storage(StorageDesc {
            source: Source::Staged { chunk: 1, offset: 512, target: Uuid([4; 16]) },
            len: 48,
            fence: Fence::Signal { chunk: 1, offset: 64, value: 5 },
        });
        tensors.push_tensor(storage, view_offset, DType::F32, shape, strides);
        ToReceiver::Message { seq: 3, sent_ns: 10, encoded_ns: 11, tensors, payload: vec![1, 2, 3] }
    }

    fn message() -> ToReceiver {
        staged(&[3, 4], &[4, 1], 0)
    }

    /// A message from another host: two NCCL transfers on communicator 2 (three tensors, two
    /// sharing the first) and two host tensors in the bytes that came before it.
    fn remote_message() -> ToReceiver {
        let mut tensors = Descriptors::unrouted(5);
        let nccl = |len| StorageDesc { source: Source::Nccl { communicator: 2 }, len, fence: Fence::None };
        let (first, second) = (tensors.push_storage(nccl(4096)), tensors.push_storage(nccl(256)));
        tensors.set_tensor(4, first, 64, DType::F32, &[8, 8], &[1, 16]);
        tensors.set_tensor(0, first, 0, DType::U8, &[16], &[1]);
        tensors.set_tensor(2, second, 0, DType::F64, &[4, 2], &[2, 1]);
        let bytes = |offset, len| StorageDesc { source: Source::Bytes { offset }, len, fence: Fence::None };
        let (a, b) = (tensors.push_storage(bytes(0, 10)), tensors.push_storage(bytes(16, 8)));
        tensors.set_tensor(1, a, 0, DType::U8, &[10], &[1]);
        tensors.set_tensor(3, b, 0, DType::I64, &[], &[]);
        assert_eq!(tensors.unrouted_tensor(), None);
        ToReceiver::Message { seq: 4, sent_ns: 1, encoded_ns: 2, tensors, payload: vec![] }
    }

    fn hellos() -> Vec<Hello> {
        vec![
            Hello {
                pid: 7,
                host: [1; 16],
                capacity: 8,
                instance: 99,
                reach: Default::default(),
                routing: Default::default(),
            },
            Hello {
                pid: 8,
                host: [1; 16],
                capacity: 4,
                instance: 5,
                reach: Reach {
                    devices: vec![
                        DeviceReach { uuid: Uuid([1; 16]), stream_ops: true },
                        DeviceReach { uuid: Uuid([2; 16]), stream_ops: false },
                    ],
                    links: vec![LinkReach {
                        from: Uuid([1; 16]),
                        to: Uuid([2; 16]),
                        peer_access: true,
                        nvlink: Some(true),
                        rank: 3,
                        native_atomics: true,
                    }],
                },
                routing: Routing::default()
                    .land(Landing::Device(Uuid([2; 16])))
                    .land_from(Uuid([1; 16]), Landing::Host)
                    .peer(PeerMode::Map)
                    .strict(Strictness::ZeroCopy),
            },
        ]
    }

    fn to_receiver() -> Vec<ToReceiver> {
        vec![
            ToReceiver::Chunk {
                id: 1,
                len: 4096,
                kind: ChunkKind::Host,
                device: [0; 16],
                legacy: None,
                writable: true,
            },
            ToReceiver::Chunk {
                id: 2,
                len: 4096,
                kind: ChunkKind::Legacy,
                device: [3; 16],
                legacy: Some(vec![5; LEGACY_HANDLE_LEN]),
                writable: false,
            },
            ToReceiver::Event { id: 4, handle: vec![6; LEGACY_HANDLE_LEN] },
            message(),
            ToReceiver::Retire { chunk: 5 },
            ToReceiver::Bytes { data: vec![9; 100] },
            ToReceiver::Communicator { id: 2, unique_id: vec![7; ipc_core::nccl::UniqueId::LEN], target: [4; 16] },
            remote_message(),
        ]
    }

    fn to_sender() -> Vec<ToSender> {
        vec![
            ToSender::Release { messages: vec![1, 2, 3] },
            ToSender::Credit { count: 1 },
            ToSender::Rejected { seq: 4, reason: "no such device".into() },
            ToSender::Close { read_up_to: 3, reason: "bye".into() },
            ToSender::ChunkLost { chunk: 7 },
        ]
    }

    /// Every sample frame's bytes, with the decoder of its direction re-encoding what decodes.
    type Redecode = fn(&[u8]) -> Option<Vec<u8>>;

    fn samples() -> Vec<(Vec<u8>, Redecode)> {
        let mut out: Vec<(Vec<u8>, Redecode)> = Vec::new();
        out.extend(hellos().iter().map(|f| (f.encode(), (|b: &[u8]| Hello::decode(b).ok().map(|f| f.encode())) as _)));
        out.extend(
            to_receiver()
                .iter()
                .map(|f| (f.encode(), (|b: &[u8]| ToReceiver::decode(b).ok().map(|f| f.encode())) as _)),
        );
        out.extend(
            to_sender().iter().map(|f| (f.encode(), (|b: &[u8]| ToSender::decode(b).ok().map(|f| f.encode())) as _)),
        );
        out
    }

    #[test]
    fn a_communicator_frame_with_an_id_of_the_wrong_length_is_refused() {
        let frame = ToReceiver::Communicator { id: 1, unique_id: vec![7; 64], target: [4; 16] };
        assert_eq!(
            ToReceiver::decode(&frame.encode()),
            Err(FrameError::Invalid("an NCCL unique id of the wrong length"))
        );
    }

    #[test]
    fn frames_round_trip() {
        for frame in hellos() {
            assert_eq!(Hello::decode(&frame.encode()), Ok(frame.clone()));
            assert_eq!(Answer::decode(&frame.encode()), Ok(Answer::Hello(frame)));
        }
        for frame in to_receiver() {
            assert_eq!(ToReceiver::decode(&frame.encode()), Ok(frame));
        }
        for frame in to_sender() {
            assert_eq!(ToSender::decode(&frame.encode()), Ok(frame));
        }
    }

    #[test]
    fn a_frame_in_the_wrong_direction_is_a_decode_error() {
        for frame in to_receiver() {
            let kind = u16::from_le_bytes([frame.encode()[6], frame.encode()[7]]);
            assert_eq!(ToSender::decode(&frame.encode()), Err(FrameError::WrongDirection { kind }));
            assert_eq!(Hello::decode(&frame.encode()), Err(FrameError::NotHello { kind }));
            assert_eq!(Answer::decode(&frame.encode()), Err(FrameError::NotHello { kind }));
        }
        for frame in to_sender() {
            let kind = u16::from_le_bytes([frame.encode()[6], frame.encode()[7]]);
            assert_eq!(ToReceiver::decode(&frame.encode()), Err(FrameError::WrongDirection { kind }));
            assert_eq!(Hello::decode(&frame.encode()), Err(FrameError::NotHello { kind }));
        }
        let hello = hellos()[0].encode();
        assert_eq!(ToReceiver::decode(&hello), Err(FrameError::WrongDirection { kind: KIND_HELLO }));
        assert_eq!(ToSender::decode(&hello), Err(FrameError::WrongDirection { kind: KIND_HELLO }));
        let mut unknown = ToSender::Credit { count: 1 }.encode();
        unknown[6..8].copy_from_slice(&99u16.to_le_bytes());
        assert_eq!(ToSender::decode(&unknown), Err(FrameError::UnknownKind(99)));
        assert_eq!(ToReceiver::decode(&unknown), Err(FrameError::UnknownKind(99)));
        // A receiver's refusal at the handshake is the one `Close` a sender reads first.
        let close = ToSender::Close { read_up_to: 0, reason: "no".into() };
        assert_eq!(Answer::decode(&close.encode()), Ok(Answer::Refused { reason: "no".into() }));
    }

    #[test]
    fn hostile_frames_are_refused_with_a_reason() {
        let good = message().encode();
        assert!(matches!(ToReceiver::decode(&good[..good.len() - 1]), Err(FrameError::Length { .. })));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(ToReceiver::decode(&bad), Err(FrameError::BadMagic(_))));
        let mut bad = good.clone();
        bad[4] = 1; // a peer of the previous protocol
        assert_eq!(ToReceiver::decode(&bad), Err(FrameError::Version(1)));
        let view_too_big = |shape: Vec<u64>, strides: Vec<i64>, view_offset: u64| {
            ToReceiver::decode(&staged(&shape, &strides, view_offset).encode())
        };
        assert!(matches!(view_too_big(vec![3, 5], vec![4, 1], 0), Err(FrameError::OutOfBounds { index: 0, .. })));
        assert!(matches!(view_too_big(vec![3, 4], vec![4, 1], 4), Err(FrameError::OutOfBounds { .. })));
        assert!(matches!(view_too_big(vec![4], vec![-1], 0), Err(FrameError::OutOfBounds { .. })));
        assert!(view_too_big(vec![4], vec![-1], 12).is_ok(), "a reversed view ending at element 0");
        assert!(matches!(view_too_big(vec![u64::MAX, 2], vec![1, 1], 0), Err(FrameError::OutOfBounds { .. })));
        let mut huge_count = ToSender::Release { messages: vec![] }.encode();
        huge_count[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(ToSender::decode(&huge_count), Err(FrameError::TooMany { what: "releases", .. })));
        // Found by an outside test: 2^60 elements of stride 0 over 512 bytes passed, and reading
        // them aborted the receiver; an unaligned f32 view passed, and reading it was undefined.
        assert!(matches!(view_too_big(vec![1 << 60], vec![0], 0), Err(FrameError::OutOfBounds { .. })));
        assert!(view_too_big(vec![1 << 20], vec![0], 0).is_ok(), "a broadcast view of modest size");
        assert!(matches!(view_too_big(vec![2], vec![1], 2), Err(FrameError::OutOfBounds { .. })));
        assert!(matches!(view_too_big(vec![1; 33], vec![1; 33], 0), Err(FrameError::TooMany { .. })));
    }

    #[test]
    fn long_frames_travel_in_parts_and_join_again() {
        let ToReceiver::Message { seq, sent_ns, encoded_ns, mut tensors, .. } = message() else { unreachable!() };
        for _ in 1..100_000 {
            tensors.push_tensor(0, 0, DType::F32, &[3, 4], &[4, 1]);
        }
        let big = ToReceiver::Message { seq, sent_ns, encoded_ns, tensors, payload: vec![7; 10 << 20] };
        let bytes = big.encode();
        let packets = packets(&bytes);
        assert!(packets.len() > 100 && packets.iter().all(|p| p.len() <= MAX_PACKET));
        let mut assembler = Assembler::default();
        let mut joined = None;
        for (i, packet) in packets.iter().enumerate() {
            let out = assembler.push::<ToReceiver>(packet, Vec::new()).unwrap();
            assert_eq!(out.is_some(), i + 1 == packets.len(), "only the last part completes the frame");
            joined = out;
        }
        assert_eq!(joined.unwrap().0, big);
        let small = ToSender::Credit { count: 3 }.encode();
        assert_eq!(packets_of(&small), 1);
        assert_eq!(assembler.push::<ToSender>(&small, Vec::new()).unwrap().unwrap().0, ToSender::Credit { count: 3 });
        // A whole frame in the middle of another's parts is a broken peer.
        let first = packets[0].to_vec();
        assembler.push::<ToReceiver>(&first, Vec::new()).unwrap();
        assert_eq!(assembler.push::<ToSender>(&small, Vec::new()).err(), Some(FrameError::Parts));
    }

    fn packets_of(frame: &[u8]) -> usize {
        packets(frame).len()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

        /// The fuzz target: arbitrary bytes never panic the decoder.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = ToReceiver::decode(&bytes);
            let _ = ToSender::decode(&bytes);
            let _ = Answer::decode(&bytes);
        }

        /// Valid frames with bytes flipped, cut or extended: refused or decoded, never a panic,
        /// and what decodes re-encodes to the same bytes.
        #[test]
        fn mutated_frames_never_panic(
            which in 0usize..15,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
            cut in any::<usize>(),
        ) {
            let (mut bytes, redecode) = samples().swap_remove(which);
            for (at, value) in flips {
                let at = at % bytes.len();
                bytes[at] = value;
            }
            bytes.truncate(cut % (bytes.len() + 1) + 12.min(bytes.len()));
            if let Some(again) = redecode(&bytes) {
                prop_assert_eq!(again, bytes);
            }
        }
    }
}
