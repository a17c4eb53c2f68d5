//! The receiver's side of the protocol for one sender's connection, as plain state machines fed
//! decoded frames: no sockets, threads or CUDA inside (the way quinn-proto keeps its protocol
//! apart from I/O). [`ConnectionProtocol`] checks what each frame from the sender may say at that
//! point (credits, announcements, which frames travel over which link) and counts what is owed
//! back; [`Owed`] holds the frames owed to the sender until its socket takes them, and decides
//! when releases go out (batched, as credits are).

use std::collections::{HashSet, VecDeque};

use crate::error::Violation;
use crate::wire::{Descriptors, Fence, MAX_RELEASES, ToReceiver, ToSender};

/// What a frame from the sender asks of the connection, once the protocol accepted it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Incoming {
    /// A frame for the I/O layer to act on (map a chunk, import an event, take bytes, join a
    /// communicator, place a message).
    Act(ToReceiver),
    /// A retired chunk: forget its mapping.
    Retired(u64),
    /// A message the protocol refuses alone (it names what was never announced): the sender
    /// hears why, and the connection goes on.
    Refused {
        /// The message's sequence number.
        seq: u64,
        /// The tensor that names it.
        index: usize,
        /// Why.
        reason: String,
    },
}

/// The receiver's protocol state for one connection.
#[derive(Debug, Default)]
pub(crate) struct ConnectionProtocol {
    /// Whether the sender is on another host (host bytes and communicators, no announcements).
    remote: bool,
    /// Messages read and not yet covered by a credit: never more than the capacity.
    uncredited: u32,
    /// Messages taken since credits were last returned.
    taken: u32,
    /// The sequence number of the last message read.
    last_seq: u64,
    /// Chunks announced and not retired.
    chunks: HashSet<u64>,
    /// Events announced.
    events: HashSet<u32>,
}

impl ConnectionProtocol {
    /// The state of a new connection from a sender on this machine or (`remote`) another host.
    pub fn new(remote: bool) -> ConnectionProtocol {
        ConnectionProtocol { remote, ..ConnectionProtocol::default() }
    }

    /// Checks a frame from the sender against the state, and records what it says. `capacity`:
    /// the messages the receiver lets a sender have unreceived. A [`Violation`] closes the
    /// connection.
    pub fn on_frame(&mut self, frame: ToReceiver, capacity: u32) -> Result<Incoming, Violation> {
        match (&frame, self.remote) {
            (ToReceiver::Chunk { .. } | ToReceiver::Event { .. } | ToReceiver::Retire { .. }, true) => {
                return Err(Violation::LocalFromRemote);
            }
            (ToReceiver::Bytes { .. } | ToReceiver::Communicator { .. }, false) => {
                return Err(Violation::RemoteFromLocal);
            }
            _ => {}
        }
        match frame {
            ToReceiver::Chunk { id, .. } => {
                self.chunks.insert(id);
            }
            ToReceiver::Event { id, .. } => {
                self.events.insert(id);
            }
            ToReceiver::Retire { chunk } => {
                self.chunks.remove(&chunk);
                return Ok(Incoming::Retired(chunk));
            }
            ToReceiver::Message { seq, ref tensors, .. } => {
                if self.uncredited >= capacity {
                    return Err(Violation::CreditExceeded { capacity });
                }
                self.uncredited += 1;
                self.last_seq = seq;
                if let Some((index, reason)) = self.unannounced(tensors) {
                    return Ok(Incoming::Refused { seq, index, reason });
                }
            }
            ToReceiver::Bytes { .. } | ToReceiver::Communicator { .. } => {}
        }
        Ok(Incoming::Act(frame))
    }

    /// What a message from a sender on this machine names that it never announced (a chunk
    /// retired, or never announced; an event never announced), for its refusal: the storage
    /// record, and why.
    fn unannounced(&self, tensors: &Descriptors) -> Option<(usize, String)> {
        if self.remote {
            return None; // its records name communicators and host bytes, never chunks
        }
        tensors.storages().iter().enumerate().find_map(|(index, record)| {
            let chunk = |id| (!self.chunks.contains(&id)).then(|| format!("unknown chunk {id}"));
            let named = record.source.chunk_range().and_then(|(id, _)| chunk(id));
            let why = named.or_else(|| match record.fence {
                Fence::None => None,
                Fence::Signal { chunk: id, .. } => chunk(id),
                Fence::Event(id) => (!self.events.contains(&id)).then(|| format!("unknown event {id}")),
            });
            why.map(|why| (index, why))
        })
    }

    /// Counts a message as taken by `recv` (or refused): the credits to return now, if any.
    /// Credits go back in batches of half the capacity, which keeps a frame off most hand-offs.
    pub fn took(&mut self, capacity: u32) -> Option<u32> {
        self.taken += 1;
        if self.taken < capacity.div_ceil(2) {
            return None;
        }
        let count = std::mem::take(&mut self.taken);
        self.uncredited -= count;
        Some(count)
    }

    /// The last message read: what a closing tells the sender (later ones are its own again).
    pub fn read_up_to(&self) -> u64 {
        self.last_seq
    }
}

/// How many releases wait for a frame of their own while messages stream: a release frame then
/// carries this many (or goes with the next credit or rejection, or when the receiver waits).
pub(crate) const RELEASE_BATCH: usize = 64;

/// What a receiver owes one sender and has not written yet: rejections, lost announcements and
/// the closing (in order), credits (adding up to one number), releases (one list). Frames go out in that order.
#[derive(Debug, Default)]
pub(crate) struct Owed {
    control: VecDeque<ToSender>,
    credits: u32,
    releases: Vec<u64>,
}

impl Owed {
    /// `count` more credits.
    pub fn credit(&mut self, count: u32) {
        self.credits += count;
    }

    /// These messages are released.
    pub fn release(&mut self, messages: impl IntoIterator<Item = u64>) {
        self.releases.extend(messages);
    }

    /// Message `seq` was refused.
    pub fn reject(&mut self, seq: u64, reason: String) {
        self.control.push_back(ToSender::Rejected { seq, reason });
    }

    /// The descriptor of `chunk`'s announcement was lost: the sender announces it again before
    /// its next message that uses it. (Ahead of the rejections of messages that used it, which
    /// the sender thus hears of after it knows.)
    pub fn chunk_lost(&mut self, chunk: u64) {
        self.control.push_back(ToSender::ChunkLost { chunk });
    }

    /// No more messages are taken; `read_up_to` is the last one read.
    pub fn close(&mut self, read_up_to: u64, reason: String) {
        self.control.push_back(ToSender::Close { read_up_to, reason });
    }

    /// Whether the releases owed may wait for company: fewer than a batch, and nothing else
    /// owed that would carry them out now anyway.
    pub fn releases_may_wait(&self) -> bool {
        self.control.is_empty() && self.credits == 0 && self.releases.len() < RELEASE_BATCH
    }

    /// The next frame to write, if anything is owed.
    pub fn next(&self) -> Option<ToSender> {
        if let Some(frame) = self.control.front() {
            Some(frame.clone())
        } else if self.credits > 0 {
            Some(ToSender::Credit { count: self.credits })
        } else if !self.releases.is_empty() {
            Some(ToSender::Release { messages: self.releases[..self.releases.len().min(MAX_RELEASES)].to_vec() })
        } else {
            None
        }
    }

    /// `frame`, returned by [`Owed::next`], was written.
    pub fn written(&mut self, frame: &ToSender) {
        match frame {
            ToSender::Credit { count } => self.credits -= count,
            ToSender::Release { messages } => drop(self.releases.drain(..messages.len())),
            ToSender::Rejected { .. } | ToSender::ChunkLost { .. } | ToSender::Close { .. } => {
                drop(self.control.pop_front())
            }
        }
    }

    /// The sender is gone, and with it what was owed.
    pub fn forget(&mut self) {
        *self = Owed::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::dtype::DType;
    use crate::wire::{ChunkKind, Source, StorageDesc};

    fn chunk(id: u64) -> ToReceiver {
        ToReceiver::Chunk { id, len: 4096, kind: ChunkKind::Host, device: [0; 16], legacy: None, writable: false }
    }

    /// A host record of 16 bytes at the start of `chunk`.
    fn desc(chunk: u64, fence: Fence) -> StorageDesc {
        StorageDesc { source: Source::Host { chunk, offset: 0 }, len: 16, fence }
    }

    /// A message of one tensor per record.
    fn message(seq: u64, records: Vec<StorageDesc>) -> ToReceiver {
        let mut tensors = Descriptors::default();
        for record in records {
            let storage = tensors.push_storage(record);
            tensors.push_tensor(storage, 0, DType::F32, &[4], &[1]);
        }
        ToReceiver::Message { seq, sent_ns: 0, encoded_ns: 0, tensors, payload: vec![] }
    }

    #[test]
    fn a_sender_writing_past_its_credits_breaks_the_protocol() {
        let mut protocol = ConnectionProtocol::new(false);
        for seq in 1..=4 {
            assert!(matches!(protocol.on_frame(message(seq, vec![]), 4), Ok(Incoming::Act(_))));
        }
        assert_eq!(protocol.on_frame(message(5, vec![]), 4), Err(Violation::CreditExceeded { capacity: 4 }));
        // Taking half the capacity returns two credits: two more may come, and no more.
        assert_eq!(protocol.took(4), None);
        assert_eq!(protocol.took(4), Some(2));
        assert!(protocol.on_frame(message(5, vec![]), 4).is_ok());
        assert!(protocol.on_frame(message(6, vec![]), 4).is_ok());
        assert_eq!(protocol.on_frame(message(7, vec![]), 4), Err(Violation::CreditExceeded { capacity: 4 }));
        assert_eq!(protocol.read_up_to(), 6);
    }

    #[test]
    fn messages_naming_unannounced_chunks_or_events_are_refused_alone() {
        let mut protocol = ConnectionProtocol::new(false);
        assert!(protocol.on_frame(chunk(5), 8).is_ok());
        assert!(matches!(protocol.on_frame(message(1, vec![desc(5, Fence::None)]), 8), Ok(Incoming::Act(_))));
        let refused = protocol.on_frame(message(2, vec![desc(5, Fence::None), desc(999, Fence::None)]), 8);
        assert_eq!(refused, Ok(Incoming::Refused { seq: 2, index: 1, reason: "unknown chunk 999".into() }));
        let signal = Fence::Signal { chunk: 6, offset: 0, value: 1 };
        assert!(matches!(
            protocol.on_frame(message(3, vec![desc(5, signal)]), 8),
            Ok(Incoming::Refused { seq: 3, .. })
        ));
        assert!(matches!(
            protocol.on_frame(message(4, vec![desc(5, Fence::Event(1))]), 8),
            Ok(Incoming::Refused { .. })
        ));
        assert!(protocol.on_frame(ToReceiver::Event { id: 1, handle: vec![] }, 8).is_ok());
        assert!(matches!(protocol.on_frame(message(5, vec![desc(5, Fence::Event(1))]), 8), Ok(Incoming::Act(_))));
        // A retired chunk is unknown again.
        assert_eq!(protocol.on_frame(ToReceiver::Retire { chunk: 5 }, 8), Ok(Incoming::Retired(5)));
        assert!(matches!(protocol.on_frame(message(6, vec![desc(5, Fence::None)]), 8), Ok(Incoming::Refused { .. })));
    }

    #[test]
    fn frames_of_the_other_kind_of_link_break_the_protocol() {
        let mut remote = ConnectionProtocol::new(true);
        assert_eq!(remote.on_frame(chunk(1), 8), Err(Violation::LocalFromRemote));
        assert_eq!(remote.on_frame(ToReceiver::Retire { chunk: 1 }, 8), Err(Violation::LocalFromRemote));
        assert!(remote.on_frame(ToReceiver::Bytes { data: vec![1] }, 8).is_ok());
        // Over TCP a message names host bytes and communicators, never announced chunks.
        assert!(matches!(remote.on_frame(message(1, vec![desc(3, Fence::None)]), 8), Ok(Incoming::Act(_))));
        let mut local = ConnectionProtocol::new(false);
        assert_eq!(local.on_frame(ToReceiver::Bytes { data: vec![1] }, 8), Err(Violation::RemoteFromLocal));
    }

    #[test]
    fn releases_wait_for_company_but_not_for_long() {
        let mut owed = Owed::default();
        owed.release([1, 2]);
        assert!(owed.releases_may_wait(), "two releases while messages stream wait for more");
        owed.credit(4);
        assert!(!owed.releases_may_wait(), "a credit going out carries them");
        assert_eq!(owed.next(), Some(ToSender::Credit { count: 4 }));
        owed.written(&ToSender::Credit { count: 4 });
        let release = owed.next().unwrap();
        assert_eq!(release, ToSender::Release { messages: vec![1, 2] });
        owed.written(&release);
        assert_eq!(owed.next(), None);
        owed.release(1..=RELEASE_BATCH as u64);
        assert!(!owed.releases_may_wait(), "a full batch goes at once");
        // Rejections and the closing go first, in order.
        owed.reject(7, "no".into());
        owed.close(9, "bye".into());
        assert!(matches!(owed.next(), Some(ToSender::Rejected { seq: 7, .. })));
        owed.written(&owed.next().unwrap());
        assert!(matches!(owed.next(), Some(ToSender::Close { read_up_to: 9, .. })));
        owed.forget();
        assert_eq!(owed.next(), None);
    }

    #[test]
    fn a_lost_announcement_is_told_before_the_rejections_it_causes() {
        let mut owed = Owed::default();
        owed.credit(1);
        owed.chunk_lost(5);
        owed.reject(2, "chunk 5 could not be mapped".into());
        let mut frames = Vec::new();
        while let Some(frame) = owed.next() {
            owed.written(&frame);
            frames.push(frame);
        }
        assert_eq!(
            frames,
            vec![
                ToSender::ChunkLost { chunk: 5 },
                ToSender::Rejected { seq: 2, reason: "chunk 5 could not be mapped".into() },
                ToSender::Credit { count: 1 },
            ]
        );
    }

    #[test]
    fn a_long_list_of_releases_goes_in_frames_of_at_most_the_limit() {
        let mut owed = Owed::default();
        owed.release(1..=(MAX_RELEASES as u64 + 5));
        let first = owed.next().unwrap();
        assert!(matches!(&first, ToSender::Release { messages } if messages.len() == MAX_RELEASES));
        owed.written(&first);
        assert_eq!(
            owed.next(),
            Some(ToSender::Release { messages: (MAX_RELEASES as u64 + 1..=MAX_RELEASES as u64 + 5).collect() })
        );
    }
}
