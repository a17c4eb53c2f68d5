//! A sender's side of the protocol as a plain state machine fed the receiver's decoded frames:
//! credits, leases, the chunks announced, the events waiting for a credit, rejections and the
//! closing. No sockets,
//! threads or CUDA inside (the way quinn-proto keeps its protocol apart from I/O): the connection
//! (`connection.rs`) holds it under its state lock, writes the frames, and drops what a frame
//! gave back outside the lock. `L` is what a message's lease holds (its tensors' storage), `E` a
//! pooled interprocess event.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::error::{Error, Refusal, Violation};
use crate::wire::ToSender;

/// A message the receiver refused (see [`Sender::take_rejected`](crate::Sender::take_rejected)).
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use std::time::Duration;
/// use tensor_queue::{Context, DType, Sender, Stream, Tensor};
/// let sender = Sender::<Tensor>::connect("/tmp/cpu-only-worker.sock")?; // a receiver without this GPU
/// let stream = Stream::new(&Context::on_ordinal(0)?)?;
/// let x = Tensor::from_slice_cuda(&[1.0f32, 2.0], DType::F32, &[2], &stream)?;
/// sender.send_on(&x, &stream)?;
/// sender.wait_released(Duration::from_secs(10)); // a refused message is given back too
/// for rejected in sender.take_rejected() {
///     eprintln!("message {} refused ({}): sending a host copy", rejected.seq, rejected.reason);
///     sender.send(&Tensor::from_bytes(&x.to_bytes()?, x.dtype(), x.shape())?)?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection {
    /// The message's sequence number on this connection: the first message sent is 1.
    pub seq: u64,
    /// Why, in the receiver's words.
    pub reason: String,
}

/// What a message holds until the receiver is done with it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Lease<L> {
    /// The storage of its tensors, given back by the receiver's release.
    Held(L),
    /// To a receiver on another host: held until its NCCL sends are done
    /// ([`SenderProtocol::remote_done`]); the receiver never releases it.
    Remote,
}

/// A sender's protocol state for one connection.
#[derive(Debug)]
pub(crate) struct SenderProtocol<L, E> {
    credits: u32,
    /// Messages sent that no credit has covered yet: a receiver may not grant more than this.
    uncredited: u32,
    /// The highest sequence number written (or being written).
    sent: u64,
    /// Per message the receiver may still hold (by `seq`).
    leases: HashMap<u64, Lease<L>>,
    /// The chunks (by id) announced to the receiver and neither retired nor lost since: a
    /// message may name them. A chunk whose announcement the receiver lost (its descriptor did
    /// not arrive) leaves the set, so that it is announced again before the next message that
    /// uses it.
    announced: HashSet<u64>,
    free_events: Vec<E>,
    /// Per message sent and not yet covered by a credit, oldest first: its event, if it has one.
    /// A credit means the receiver took the message and so already queued its wait on the
    /// event; only then may the event be recorded again. The pool thus stays within the capacity.
    untaken: VecDeque<Option<E>>,
    next_event: u32,
    /// Whether the receiver's `Hello` was read.
    greeted: bool,
    /// Why the receiver takes no more messages, once it does not.
    closed: Option<String>,
    /// Whether the receiver's `Close` came (after it, only releases and credits may).
    close_read: bool,
    /// Why the receiver refused this sender at the handshake, if it did.
    refused: Option<Refusal>,
    rejected: Vec<Rejection>,
    /// Leases given back whose storage is still being dropped (which may retire a chunk): still
    /// outstanding, so that nothing is announced before the retirement is sent.
    dropping: usize,
}

impl<L, E> Default for SenderProtocol<L, E> {
    fn default() -> Self {
        SenderProtocol {
            credits: 0,
            uncredited: 0,
            sent: 0,
            leases: HashMap::new(),
            announced: HashSet::new(),
            free_events: Vec::new(),
            untaken: VecDeque::new(),
            next_event: 0,
            greeted: false,
            closed: None,
            close_read: false,
            refused: None,
            rejected: Vec::new(),
            dropping: 0,
        }
    }
}

impl<L, E> SenderProtocol<L, E> {
    /// The receiver's `Hello` came: `capacity` messages may be in flight. (No credits until then:
    /// until then the receiver is not receiving, which is what a full queue means too.)
    pub fn greeted(&mut self, capacity: u32) {
        self.credits = capacity;
        self.greeted = true;
    }

    /// The receiver refused this sender at the handshake.
    pub fn refused(&mut self, refusal: Refusal) {
        self.refused = Some(refusal);
    }

    /// Whether the receiver's `Hello` came.
    pub fn is_greeted(&self) -> bool {
        self.greeted
    }

    /// Why the receiver takes no more messages, if it does not.
    pub fn closed(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    /// Credits left.
    pub fn credits(&self) -> u32 {
        self.credits
    }

    /// Why nothing more can be sent, if so.
    pub fn ended(&self) -> Option<Error> {
        match (&self.refused, &self.closed) {
            (Some(refused), _) => Some(Error::PeerRefused(refused.clone())),
            (None, Some(_)) => Some(Error::Disconnected),
            (None, None) => None,
        }
    }

    /// Takes a credit for a message: `Ok(false)` if none is left.
    pub fn take_credit(&mut self) -> Result<bool, Error> {
        if let Some(ended) = self.ended() {
            return Err(ended);
        }
        if self.credits == 0 {
            return Ok(false);
        }
        self.credits -= 1;
        self.uncredited += 1;
        Ok(true)
    }

    /// Gives back a credit taken for a message not sent.
    pub fn return_credit(&mut self) {
        self.credits += 1;
        self.uncredited -= 1;
    }

    /// Message `seq` is about to be written, holding `lease` (none for a message without
    /// tensors: the receiver releases only messages with tensors). [`Error::Disconnected`] if
    /// the receiver closed: then the message must not be written.
    pub fn writing(&mut self, seq: u64, lease: Option<Lease<L>>) -> Result<(), Error> {
        if self.closed.is_some() {
            return Err(Error::Disconnected);
        }
        self.sent = self.sent.max(seq);
        if let Some(lease) = lease {
            self.leases.insert(seq, lease);
        }
        Ok(())
    }

    /// Message `seq` was written; `event` is the one it recorded, if any.
    pub fn written(&mut self, event: Option<E>) {
        self.untaken.push_back(event);
    }

    /// Writing message `seq` failed: its credit comes back, and its lease (returned, to drop
    /// outside the lock). A write that found the receiver gone closes the connection.
    pub fn unwritten(&mut self, seq: u64, gone: bool) -> Option<Lease<L>> {
        if gone {
            self.closed.get_or_insert_with(|| "the receiver is gone".into());
        }
        self.return_credit();
        self.sent = seq - 1;
        self.leases.remove(&seq)
    }

    /// Whether `chunk` must be announced before a message may name it.
    pub fn needs_announcing(&self, chunk: u64) -> bool {
        !self.announced.contains(&chunk)
    }

    /// `chunk` is being announced (marked before its frame is written: the receiver may answer
    /// that it lost it as soon as the frame is out).
    pub fn announcing(&mut self, chunk: u64) {
        self.announced.insert(chunk);
    }

    /// `chunk` is not announced: its announcement could not be written, or it is retired (its
    /// memory is gone, and its `Retire` is being written).
    pub fn forget_chunk(&mut self, chunk: u64) {
        self.announced.remove(&chunk);
    }

    /// The NCCL sends of message `seq` (to another host) are done.
    pub fn remote_done(&mut self, seq: u64) {
        self.leases.remove(&seq);
    }

    /// A pooled event, if one is free.
    pub fn free_event(&mut self) -> Option<E> {
        self.free_events.pop()
    }

    /// An event that was not used (or could not be recorded) goes back to the pool.
    pub fn give_back_event(&mut self, event: E) {
        self.free_events.push(event);
    }

    /// The id for a new event.
    pub fn new_event_id(&mut self) -> u32 {
        self.next_event += 1;
        self.next_event
    }

    /// Messages the receiver may still hold, and leases still being dropped.
    pub fn outstanding(&self) -> usize {
        self.leases.len() + self.dropping
    }

    /// `count` leases given back are being dropped (outside the lock); [`SenderProtocol::dropped`]
    /// when done.
    pub fn dropping(&mut self, count: usize) {
        self.dropping += count;
    }

    /// See [`SenderProtocol::dropping`].
    pub fn dropped(&mut self, count: usize) {
        self.dropping -= count;
    }

    /// The rejections heard since last asked.
    pub fn take_rejected(&mut self) -> Vec<Rejection> {
        std::mem::take(&mut self.rejected)
    }

    /// What the receiver said: the storage it gave back (to drop outside the lock), or how it
    /// broke the protocol (the connection must close).
    pub fn on_frame(&mut self, frame: ToSender) -> Result<Vec<L>, Violation> {
        let mut released = Vec::new();
        match frame {
            ToSender::Release { messages } => {
                for seq in messages {
                    match self.leases.remove(&seq) {
                        Some(Lease::Held(lease)) => released.push(lease),
                        Some(Lease::Remote) | None => return Err(Violation::UnknownRelease { seq }),
                    }
                }
            }
            ToSender::Credit { count } => {
                if count > self.uncredited {
                    return Err(Violation::OverCredited { granted: count, uncredited: self.uncredited });
                }
                self.credits += count;
                self.uncredited -= count;
                for _ in 0..count {
                    if let Some(Some(event)) = self.untaken.pop_front() {
                        self.free_events.push(event);
                    }
                }
            }
            ToSender::Rejected { seq, reason } => {
                if self.close_read {
                    return Err(Violation::AfterClose);
                }
                if seq == 0 || seq > self.sent {
                    return Err(Violation::UnknownRejection { seq });
                }
                // Its lease comes back by the release that follows (from a receiver on another
                // host, when its NCCL sends end).
                self.rejected.push(Rejection { seq, reason });
            }
            ToSender::ChunkLost { chunk } => {
                if self.close_read {
                    return Err(Violation::AfterClose);
                }
                // Announced again before the next message that uses it. (A chunk retired since
                // is no longer in the set: nothing to do, its `Retire` is on its way.)
                self.announced.remove(&chunk);
            }
            ToSender::Close { read_up_to, reason } => {
                if self.close_read {
                    return Err(Violation::AfterClose);
                }
                self.close_read = true;
                self.closed.get_or_insert(reason);
                // Messages it never read are ours again; those it read come back by release.
                let unread: Vec<u64> = self.leases.keys().copied().filter(|&seq| seq > read_up_to).collect();
                for seq in unread {
                    if let Some(Lease::Held(lease)) = self.leases.remove(&seq) {
                        released.push(lease);
                    }
                }
            }
        }
        Ok(released)
    }

    /// The connection ended (the receiver is gone, or broke the protocol): every lease comes
    /// back (to drop outside the lock).
    pub fn hang_up(&mut self, why: &str) -> Vec<L> {
        self.closed.get_or_insert_with(|| why.to_string());
        std::mem::take(&mut self.leases)
            .into_values()
            .filter_map(|lease| match lease {
                Lease::Held(lease) => Some(lease),
                Lease::Remote => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease's storage, and an event, as plain numbers.
    type Protocol = SenderProtocol<&'static str, u32>;

    fn greeted(capacity: u32) -> Protocol {
        let mut protocol = Protocol::default();
        protocol.greeted(capacity);
        protocol
    }

    /// Sends message `seq`, with a lease named `lease` if any.
    fn send(protocol: &mut Protocol, seq: u64, lease: Option<&'static str>) {
        assert!(protocol.take_credit().unwrap(), "a credit for message {seq}");
        protocol.writing(seq, lease.map(Lease::Held)).unwrap();
        protocol.written(None);
    }

    #[test]
    fn a_sender_has_no_credit_past_the_receivers_capacity() {
        let mut protocol = greeted(2);
        send(&mut protocol, 1, None);
        send(&mut protocol, 2, None);
        assert!(!protocol.take_credit().unwrap(), "the third message waits");
        assert_eq!(protocol.on_frame(ToSender::Credit { count: 1 }), Ok(vec![]));
        send(&mut protocol, 3, None);
        assert!(!protocol.take_credit().unwrap());
    }

    #[test]
    fn a_receiver_granting_more_than_was_sent_breaks_the_protocol() {
        let mut protocol = greeted(4);
        send(&mut protocol, 1, None);
        send(&mut protocol, 2, None);
        assert_eq!(
            protocol.on_frame(ToSender::Credit { count: 3 }),
            Err(Violation::OverCredited { granted: 3, uncredited: 2 })
        );
        assert_eq!(protocol.on_frame(ToSender::Credit { count: 2 }), Ok(vec![]));
        assert_eq!(protocol.credits(), 4);
        assert!(protocol.on_frame(ToSender::Credit { count: 1 }).is_err(), "nothing is uncredited any more");
    }

    #[test]
    fn a_release_of_an_unknown_or_repeated_message_breaks_the_protocol() {
        let mut protocol = greeted(8);
        send(&mut protocol, 1, Some("one"));
        send(&mut protocol, 2, None); // no tensors: nothing to release
        send(&mut protocol, 3, Some("three"));
        assert_eq!(protocol.outstanding(), 2);
        assert_eq!(protocol.on_frame(ToSender::Release { messages: vec![3, 1] }), Ok(vec!["three", "one"]));
        assert_eq!(protocol.outstanding(), 0);
        let again = protocol.on_frame(ToSender::Release { messages: vec![1] });
        assert_eq!(again, Err(Violation::UnknownRelease { seq: 1 }), "released twice");
        let leaseless = protocol.on_frame(ToSender::Release { messages: vec![2] });
        assert_eq!(leaseless, Err(Violation::UnknownRelease { seq: 2 }), "a message without tensors");
        let unsent = protocol.on_frame(ToSender::Release { messages: vec![9] });
        assert_eq!(unsent, Err(Violation::UnknownRelease { seq: 9 }), "never sent");
    }

    #[test]
    fn a_remote_message_is_leased_until_its_transfers_end_never_released_by_frame() {
        let mut protocol = greeted(8);
        assert!(protocol.take_credit().unwrap());
        protocol.writing(1, Some(Lease::Remote)).unwrap();
        protocol.written(None);
        assert_eq!(protocol.outstanding(), 1);
        assert_eq!(
            protocol.on_frame(ToSender::Release { messages: vec![1] }),
            Err(Violation::UnknownRelease { seq: 1 })
        );
        protocol.remote_done(1);
        assert_eq!(protocol.outstanding(), 0);
    }

    #[test]
    fn a_closing_gives_back_what_was_never_read_and_ends_sending() {
        let mut protocol = greeted(8);
        for (seq, lease) in [(1, "one"), (2, "two"), (3, "three")] {
            send(&mut protocol, seq, Some(lease));
        }
        let close = ToSender::Close { read_up_to: 1, reason: "bye".into() };
        let mut unread = protocol.on_frame(close).unwrap();
        unread.sort();
        assert_eq!(unread, vec!["three", "two"]);
        assert!(matches!(protocol.take_credit(), Err(Error::Disconnected)));
        assert!(matches!(protocol.writing(4, None), Err(Error::Disconnected)));
        // What it read comes back by release; a rejection or a second closing is a lie.
        assert_eq!(protocol.on_frame(ToSender::Release { messages: vec![1] }), Ok(vec!["one"]));
        let rejected = ToSender::Rejected { seq: 1, reason: "late".into() };
        assert_eq!(protocol.on_frame(rejected), Err(Violation::AfterClose));
        let again = ToSender::Close { read_up_to: 1, reason: "bye".into() };
        assert_eq!(protocol.on_frame(again), Err(Violation::AfterClose));
    }

    #[test]
    fn a_rejection_names_a_message_sent_and_its_lease_comes_back_by_release() {
        let mut protocol = greeted(8);
        send(&mut protocol, 1, Some("one"));
        let unsent = ToSender::Rejected { seq: 2, reason: "no".into() };
        assert_eq!(protocol.on_frame(unsent), Err(Violation::UnknownRejection { seq: 2 }));
        assert_eq!(protocol.on_frame(ToSender::Rejected { seq: 1, reason: "no GPU".into() }), Ok(vec![]));
        assert_eq!(protocol.take_rejected(), vec![Rejection { seq: 1, reason: "no GPU".into() }]);
        assert_eq!(protocol.outstanding(), 1, "held until the release");
        assert_eq!(protocol.on_frame(ToSender::Release { messages: vec![1] }), Ok(vec!["one"]));
    }

    #[test]
    fn events_go_back_to_the_pool_once_credited_and_a_failed_write_gives_all_back() {
        let mut protocol = greeted(2);
        assert!(protocol.take_credit().unwrap());
        protocol.writing(1, Some(Lease::Held("one"))).unwrap();
        protocol.written(Some(7));
        assert_eq!(protocol.free_event(), None, "event 7 is in use until the message is taken");
        protocol.on_frame(ToSender::Credit { count: 1 }).unwrap();
        assert_eq!(protocol.free_event(), Some(7));
        assert!(protocol.take_credit().unwrap());
        protocol.writing(2, Some(Lease::Held("two"))).unwrap();
        assert_eq!(protocol.unwritten(2, true), Some(Lease::Held("two")));
        assert_eq!(protocol.credits(), 2, "the credit came back");
        assert!(matches!(protocol.take_credit(), Err(Error::Disconnected)), "the receiver is gone");
        assert_eq!(protocol.hang_up("gone"), vec!["one"]);
        assert_eq!(protocol.outstanding(), 0);
    }

    #[test]
    fn a_chunk_the_receiver_lost_is_announced_again_and_a_retired_one_stays_forgotten() {
        let mut protocol = greeted(8);
        assert!(protocol.needs_announcing(3));
        protocol.announcing(3);
        protocol.announcing(4);
        assert!(!protocol.needs_announcing(3), "announced once per connection");
        send(&mut protocol, 1, Some("one"));
        // The descriptor of chunk 3 never reached the receiver: the next message announces it again.
        assert_eq!(protocol.on_frame(ToSender::ChunkLost { chunk: 3 }), Ok(vec![]));
        assert!(protocol.needs_announcing(3));
        assert!(!protocol.needs_announcing(4), "only the lost chunk");
        protocol.announcing(3);
        assert!(!protocol.needs_announcing(3));
        // Retired here while the receiver said it lost it: the loss changes nothing.
        protocol.forget_chunk(4);
        assert_eq!(protocol.on_frame(ToSender::ChunkLost { chunk: 4 }), Ok(vec![]));
        assert_eq!(protocol.on_frame(ToSender::ChunkLost { chunk: 99 }), Ok(vec![]), "never announced");
        assert!(protocol.needs_announcing(4) && !protocol.needs_announcing(3));
        // After the closing, only releases and credits may come.
        protocol.on_frame(ToSender::Close { read_up_to: 1, reason: "bye".into() }).unwrap();
        assert_eq!(protocol.on_frame(ToSender::ChunkLost { chunk: 3 }), Err(Violation::AfterClose));
    }

    #[test]
    fn a_refused_sender_hears_why() {
        let mut protocol = Protocol::default();
        protocol.refused(Refusal::OtherMachine);
        assert!(matches!(protocol.take_credit(), Err(Error::PeerRefused(Refusal::OtherMachine))));
    }
}
