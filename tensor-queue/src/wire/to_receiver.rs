//! The frames a sender sends a receiver after the greeting ([`ToReceiver`]): chunk and event
//! announcements, messages, retirements, and over TCP host bytes and NCCL communicators. The
//! receiver's reader decodes only these: any other kind is [`FrameError::WrongDirection`].

use super::{
    ChunkKind, Descriptors, Frame, FrameError, KIND_BYTES, KIND_CHUNK, KIND_COMMUNICATOR, KIND_EVENT, KIND_MESSAGE,
    KIND_RETIRE, LEGACY_HANDLE_LEN, MAX_MESSAGE_BYTES, Reader, Writer, begin, decode_table, encode_table, end, open,
    other_kind,
};

/// Everything a sender sends a receiver after the greeting.
///
/// ```
/// # fn main() -> Result<(), tensor_queue::FrameError> {
/// use tensor_queue::testing::wire::{Frame, ToReceiver};
/// assert_eq!(ToReceiver::decode(&ToReceiver::Retire { chunk: 5 }.encode())?, ToReceiver::Retire { chunk: 5 });
/// assert!(ToReceiver::decode(&[0xff; 64]).is_err()); // an error, never a panic, whatever the bytes
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToReceiver {
    /// A chunk the following messages use; host and VMM chunks carry one descriptor.
    Chunk {
        /// The sender's id for the chunk.
        id: u64,
        /// The chunk's length.
        len: u64,
        /// What it is.
        kind: ChunkKind,
        /// The device, for GPU chunks.
        device: [u8; 16],
        /// The legacy IPC handle, for `Legacy` chunks.
        legacy: Option<Vec<u8>>,
        /// Host chunks: whether the descriptor lets the receiver write (else it is read-only).
        writable: bool,
    },
    /// An interprocess event the following messages may name.
    Event {
        /// The sender's id for the event.
        id: u32,
        /// The exported event handle.
        handle: Vec<u8>,
    },
    /// A message: tensor descriptors and the serde payload.
    Message {
        /// Sequence number on this connection.
        seq: u64,
        /// `CLOCK_MONOTONIC` nanoseconds when `send` was called.
        sent_ns: u64,
        /// `CLOCK_MONOTONIC` nanoseconds when encoding finished.
        encoded_ns: u64,
        /// The descriptor table: storage records and tensors, in the order the payload refers to
        /// them.
        tensors: Descriptors,
        /// The serde bytes of the message.
        payload: Vec<u8>,
    },
    /// The sender freed this chunk: forget its mapping, so its memory goes back to the driver (and
    /// a user buffer's address may be reused for other memory).
    Retire {
        /// The chunk's id.
        chunk: u64,
    },
    /// Over TCP: bytes of the host tensors of the next message (`Route::Tcp`), appended to
    /// what came before; the message's descriptors say where each tensor lies in them.
    Bytes {
        /// The bytes.
        data: Vec<u8>,
    },
    /// Over TCP: the sender set up an NCCL communicator of two ranks (itself rank 0) for tensors
    /// landing on the receiver's GPU `target`; the receiver joins as rank 1. Messages name it by
    /// `id` (`Route::Nccl`).
    Communicator {
        /// The sender's id for it.
        id: u32,
        /// `ncclGetUniqueId`'s bytes.
        unique_id: Vec<u8>,
        /// The receiver's GPU.
        target: [u8; 16],
    },
}

impl ToReceiver {
    fn kind(&self) -> u16 {
        match self {
            ToReceiver::Chunk { .. } => KIND_CHUNK,
            ToReceiver::Event { .. } => KIND_EVENT,
            ToReceiver::Message { .. } => KIND_MESSAGE,
            ToReceiver::Retire { .. } => KIND_RETIRE,
            ToReceiver::Bytes { .. } => KIND_BYTES,
            ToReceiver::Communicator { .. } => KIND_COMMUNICATOR,
        }
    }

    /// Each frame's body, written here and read in [`ToReceiver::read_body`] in the same order.
    fn write_body(&self, w: &mut Writer) {
        match self {
            ToReceiver::Chunk { id, len, kind, device, legacy, writable } => {
                w.u64(*id);
                w.u64(*len);
                w.u8(*kind as u8);
                w.bytes(device);
                w.u32(legacy.as_ref().map_or(0, |h| h.len() as u32));
                w.bytes(legacy.as_deref().unwrap_or_default());
                w.u8(u8::from(*writable));
            }
            ToReceiver::Event { id, handle } => {
                w.u32(*id);
                w.u32(handle.len() as u32);
                w.bytes(handle);
            }
            ToReceiver::Message { seq, sent_ns, encoded_ns, tensors, payload } => {
                w.u64(*seq);
                w.u64(*sent_ns);
                w.u64(*encoded_ns);
                encode_table(w, tensors);
                w.u32(payload.len() as u32);
                w.bytes(payload);
            }
            ToReceiver::Retire { chunk } => w.u64(*chunk),
            ToReceiver::Bytes { data } => {
                w.u32(data.len() as u32);
                w.bytes(data);
            }
            ToReceiver::Communicator { id, unique_id, target } => {
                w.u32(*id);
                w.u32(unique_id.len() as u32);
                w.bytes(unique_id);
                w.bytes(target);
            }
        }
    }

    fn read_body(kind: u16, r: &mut Reader<'_>) -> Result<ToReceiver, FrameError> {
        Ok(match kind {
            KIND_CHUNK => {
                let (id, len) = (r.u64()?, r.u64()?);
                let kind = match r.u8()? {
                    1 => ChunkKind::Host,
                    2 => ChunkKind::Vmm,
                    3 => ChunkKind::Legacy,
                    _ => return Err(FrameError::Invalid("chunk kind")),
                };
                let device = r.array()?;
                let handle_len = r.count("handle bytes", LEGACY_HANDLE_LEN)?;
                let legacy = (handle_len > 0).then(|| r.take(handle_len).map(<[u8]>::to_vec)).transpose()?;
                let writable = match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(FrameError::Invalid("chunk flags")),
                };
                if (kind == ChunkKind::Legacy) != (handle_len == LEGACY_HANDLE_LEN) || len == 0 {
                    return Err(FrameError::Invalid("chunk announcement"));
                }
                ToReceiver::Chunk { id, len, kind, device, legacy, writable }
            }
            KIND_EVENT => {
                let id = r.u32()?;
                let len = r.count("handle bytes", LEGACY_HANDLE_LEN)?;
                ToReceiver::Event { id, handle: r.take(len)?.to_vec() }
            }
            KIND_MESSAGE => {
                let (seq, sent_ns, encoded_ns) = (r.u64()?, r.u64()?, r.u64()?);
                let body = r.body_len();
                let tensors = decode_table(r, body)?;
                let len = r.count("payload bytes", MAX_MESSAGE_BYTES)?;
                ToReceiver::Message { seq, sent_ns, encoded_ns, tensors, payload: r.take(len)?.to_vec() }
            }
            KIND_RETIRE => ToReceiver::Retire { chunk: r.u64()? },
            KIND_BYTES => {
                let len = r.count("bytes", MAX_MESSAGE_BYTES)?;
                ToReceiver::Bytes { data: r.take(len)?.to_vec() }
            }
            KIND_COMMUNICATOR => {
                let id = r.u32()?;
                let len = r.count("unique id bytes", ipc_core::nccl::UniqueId::LEN)?;
                if len != ipc_core::nccl::UniqueId::LEN {
                    return Err(FrameError::Invalid("an NCCL unique id of the wrong length"));
                }
                ToReceiver::Communicator { id, unique_id: r.take(len)?.to_vec(), target: r.array()? }
            }
            other => return Err(other_kind(other)),
        })
    }
}

impl Frame for ToReceiver {
    fn encode(&self) -> Vec<u8> {
        let mut w = begin(self.kind());
        self.write_body(&mut w);
        end(w)
    }

    /// Decodes and validates one frame. Never panics, whatever the bytes. A frame a receiver
    /// sends (a credit, a release, a `Hello`) is [`FrameError::WrongDirection`].
    ///
    /// ```
    /// use tensor_queue::FrameError;
    /// use tensor_queue::testing::wire::{Frame, ToReceiver, ToSender};
    /// let credit = ToSender::Credit { count: 1 }.encode();
    /// assert_eq!(ToReceiver::decode(&credit), Err(FrameError::WrongDirection { kind: 6 }));
    /// ```
    fn decode(bytes: &[u8]) -> Result<ToReceiver, FrameError> {
        let (kind, mut r) = open(bytes)?;
        let frame = ToReceiver::read_body(kind, &mut r)?;
        r.finish()?;
        Ok(frame)
    }
}
