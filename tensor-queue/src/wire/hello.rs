//! The first frame each way: who is speaking, and (from a receiver) how many messages may be in
//! flight, its GPUs and its routing policy. A sender reads an [`Answer`]: the receiver's `Hello`,
//! or the `Close` of a receiver that refused it.

use super::routing::{decode_reach, decode_routing, encode_reach, encode_routing};
use super::to_sender::ToSender;
use super::{Frame, FrameError, KIND_CLOSE, KIND_HELLO, begin, end, open};
use crate::route::{Reach, Routing};

/// First frame each way: who is speaking, and (from a receiver) how many messages may be in flight.
///
/// ```
/// # fn main() -> Result<(), tensor_queue::FrameError> {
/// use tensor_queue::testing::wire::{Frame, Hello};
/// let hello = Hello { pid: 7, host: [1; 16], capacity: 8, instance: 99, reach: Default::default(), routing: Default::default() };
/// assert_eq!(Hello::decode(&hello.encode())?, hello);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Process id.
    pub pid: u32,
    /// Boot id of the machine.
    pub host: [u8; 16],
    /// Messages the sender may have unreceived at once (0 from a sender).
    pub capacity: u32,
    /// A random number drawn once per process: with the pid, it names the process for good
    /// (a pid alone may be reused after the process dies).
    pub instance: u64,
    /// From a receiver: its GPUs and what each can reach (empty from a sender).
    pub reach: Reach,
    /// From a receiver: where tensors should land, and what it refuses.
    pub routing: Routing,
}

impl Frame for Hello {
    fn encode(&self) -> Vec<u8> {
        let mut w = begin(KIND_HELLO);
        w.u32(self.pid);
        w.bytes(&self.host);
        w.u32(self.capacity);
        w.u64(self.instance);
        encode_reach(&mut w, &self.reach);
        encode_routing(&mut w, &self.routing);
        end(w)
    }

    /// A frame of another kind is [`FrameError::NotHello`].
    fn decode(bytes: &[u8]) -> Result<Hello, FrameError> {
        let (kind, mut r) = open(bytes)?;
        if kind != KIND_HELLO {
            return Err(FrameError::NotHello { kind });
        }
        let hello = Hello {
            pid: r.u32()?,
            host: r.array()?,
            capacity: r.u32()?,
            instance: r.u64()?,
            reach: decode_reach(&mut r)?,
            routing: decode_routing(&mut r)?,
        };
        r.finish()?;
        Ok(hello)
    }
}

/// What a sender reads first: the receiver's `Hello`, or the `Close` of a receiver that refused
/// it at the handshake (another user, no descriptors left).
///
/// ```
/// # fn main() -> Result<(), tensor_queue::FrameError> {
/// use tensor_queue::testing::wire::{Answer, Frame, ToSender};
/// let refused = ToSender::Close { read_up_to: 0, reason: "another user".into() }.encode();
/// assert_eq!(Answer::decode(&refused)?, Answer::Refused { reason: "another user".into() });
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The receiver's greeting.
    Hello(Hello),
    /// The receiver refused this sender, and said why.
    Refused {
        /// Why, for people.
        reason: String,
    },
}

impl Frame for Answer {
    fn encode(&self) -> Vec<u8> {
        match self {
            Answer::Hello(hello) => hello.encode(),
            Answer::Refused { reason } => ToSender::Close { read_up_to: 0, reason: reason.clone() }.encode(),
        }
    }

    fn decode(bytes: &[u8]) -> Result<Answer, FrameError> {
        let (kind, _) = open(bytes)?;
        match kind {
            KIND_CLOSE => match ToSender::decode(bytes)? {
                ToSender::Close { reason, .. } => Ok(Answer::Refused { reason }),
                _ => Err(FrameError::NotHello { kind }),
            },
            _ => Hello::decode(bytes).map(Answer::Hello),
        }
    }
}
