//! The frames a receiver sends a sender after the greeting ([`ToSender`]): credits, releases,
//! rejections, lost announcements and the closing. The sender's reader decodes only these: any other kind is
//! [`FrameError::WrongDirection`].

use super::{
    Frame, FrameError, KIND_CHUNK_LOST, KIND_CLOSE, KIND_CREDIT, KIND_REJECTED, KIND_RELEASE, MAX_RELEASES, Reader,
    Writer, begin, end, open, other_kind,
};

/// Everything a receiver sends a sender after the greeting.
///
/// ```
/// # fn main() -> Result<(), tensor_queue::FrameError> {
/// use tensor_queue::testing::wire::{Frame, ToSender};
/// // What a receiver sends once its caller took 8 messages: 8 more may come.
/// let credit = ToSender::Credit { count: 8 };
/// assert_eq!(ToSender::decode(&credit.encode())?, credit);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToSender {
    /// The receiver is done with these messages (by `seq`): their tensors' memory may be reused.
    Release {
        /// Message sequence numbers.
        messages: Vec<u64>,
    },
    /// The receiver took this many messages out of its queue.
    Credit {
        /// How many.
        count: u32,
    },
    /// The receiver refused one message; it holds nothing of it, and the connection goes on.
    Rejected {
        /// The message's sequence number.
        seq: u64,
        /// Why, for people.
        reason: String,
    },
    /// The descriptor of this chunk's announcement never reached the receiver (its descriptor
    /// table was full when the announcement was read): it maps nothing of the chunk, and refuses
    /// the messages that use it until the chunk is announced again, which the sender does before
    /// its next message that uses it.
    ChunkLost {
        /// The sender's id of the chunk.
        chunk: u64,
    },
    /// The receiver takes no more messages on this connection. Releases of what it still holds
    /// follow; the socket closes when it holds nothing (or its process ends).
    Close {
        /// The last message it read: later ones it never saw, and their leases are the sender's.
        read_up_to: u64,
        /// Why, for people.
        reason: String,
    },
}

impl ToSender {
    fn kind(&self) -> u16 {
        match self {
            ToSender::Release { .. } => KIND_RELEASE,
            ToSender::Credit { .. } => KIND_CREDIT,
            ToSender::Rejected { .. } => KIND_REJECTED,
            ToSender::ChunkLost { .. } => KIND_CHUNK_LOST,
            ToSender::Close { .. } => KIND_CLOSE,
        }
    }

    /// Each frame's body, written here and read in [`ToSender::read_body`] in the same order.
    fn write_body(&self, w: &mut Writer) {
        match self {
            ToSender::Release { messages } => {
                w.u32(messages.len() as u32);
                messages.iter().for_each(|&seq| w.u64(seq));
            }
            ToSender::Credit { count } => w.u32(*count),
            ToSender::Rejected { seq, reason } => {
                w.u64(*seq);
                w.text(reason);
            }
            ToSender::ChunkLost { chunk } => w.u64(*chunk),
            ToSender::Close { read_up_to, reason } => {
                w.u64(*read_up_to);
                w.text(reason);
            }
        }
    }

    fn read_body(kind: u16, r: &mut Reader<'_>) -> Result<ToSender, FrameError> {
        Ok(match kind {
            KIND_RELEASE => {
                let count = r.count("releases", MAX_RELEASES)?;
                ToSender::Release { messages: (0..count).map(|_| r.u64()).collect::<Result<_, _>>()? }
            }
            KIND_CREDIT => ToSender::Credit { count: r.u32()? },
            KIND_REJECTED => ToSender::Rejected { seq: r.u64()?, reason: r.text()? },
            KIND_CHUNK_LOST => ToSender::ChunkLost { chunk: r.u64()? },
            KIND_CLOSE => ToSender::Close { read_up_to: r.u64()?, reason: r.text()? },
            other => return Err(other_kind(other)),
        })
    }
}

impl Frame for ToSender {
    /// ```
    /// use tensor_queue::testing::wire::{Frame, ToSender};
    /// let bytes = ToSender::Release { messages: vec![1, 2, 3] }.encode();
    /// assert_eq!(bytes.len(), 12 + 4 + 3 * 8); // header, count, one u64 per message
    /// ```
    fn encode(&self) -> Vec<u8> {
        let mut w = begin(self.kind());
        self.write_body(&mut w);
        end(w)
    }

    /// A frame a sender sends (a message, an announcement, a `Hello`) is
    /// [`FrameError::WrongDirection`].
    ///
    /// ```
    /// use tensor_queue::FrameError;
    /// use tensor_queue::testing::wire::{Frame, ToReceiver, ToSender};
    /// let retire = ToReceiver::Retire { chunk: 5 }.encode();
    /// assert_eq!(ToSender::decode(&retire), Err(FrameError::WrongDirection { kind: 7 }));
    /// ```
    fn decode(bytes: &[u8]) -> Result<ToSender, FrameError> {
        let (kind, mut r) = open(bytes)?;
        let frame = ToSender::read_body(kind, &mut r)?;
        r.finish()?;
        Ok(frame)
    }
}
