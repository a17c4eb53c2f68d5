//! One sender's connection to its receiver, below the typed [`Sender`](crate::Sender): credits,
//! leases, announcements, the event pool, the thread that reads the receiver's answers, and the
//! hang-up. A receiver on this machine and one on another host are the two flavors ([`Flavor`]).
//!
//! Two locks, never nested the other way round: `state` (credits, leases, events, what the
//! receiver said) is only ever held briefly and never across a socket write, so the reader thread
//! can always take releases and credits, and `is_connected` or `outstanding_leases` never wait
//! for a blocked send; `writer` (announcements and sequence numbers) is held across the writes of
//! one message, so its frames reach the socket whole and in order.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering as Atomic};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ipc_core::{Event, Stream, Uuid};

use super::network::{self, SendComms};
use super::outgoing::{Fencing, Outgoing};
use crate::error::{Error, Refusal, Result};
use crate::fences::liveness::Gone;
use crate::links::link::{Link, Read};
use crate::links::poll::PollSet;
use crate::memory::arena::{Chunk, RetireListener, Shared};
use crate::route::{self, Choice, Reach, Routing, choose};
use crate::sync::lock;
use crate::tensor::Storage;
use crate::wire::{Assembler, ChunkKind, Fence, Frame, MAX_PACKET, TensorDesc};

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

/// An interprocess event of one connection, exported once.
struct EventSlot {
    id: u32,
    event: Event,
}

#[derive(Default)]
struct SenderState {
    credits: u32,
    /// Messages sent that no credit has covered yet: a receiver may not grant more than this.
    uncredited: u32,
    /// Per message the receiver may still hold (by `seq`): the storage of its tensors.
    leases: HashMap<u64, Vec<Arc<Storage>>>,
    free_events: Vec<EventSlot>,
    /// Per message sent and not yet covered by a credit, oldest first: its event, if it has one.
    /// A credit means the receiver took the message and so already queued its wait on the
    /// event; only then may the event be recorded again. The pool thus stays within the capacity.
    untaken: VecDeque<Option<EventSlot>>,
    next_event: u32,
    /// Whether the receiver's `Hello` was read: until then only the reader thread reads.
    greeted: bool,
    /// The receiver's GPUs and routing policy, from its `Hello`.
    receiver: Option<Arc<(Reach, Routing)>>,
    /// Why the receiver takes no more messages, once it does not.
    closed: Option<String>,
    /// Why the receiver refused this sender at the handshake, if it did.
    refused: Option<Refusal>,
    rejected: Vec<Rejection>,
    /// Leases removed from `leases` whose storage is still being dropped (which may retire a
    /// chunk): still outstanding, so that nothing is announced before the retirement is sent.
    dropping: usize,
}

/// What only the thread writing a message touches.
#[derive(Default)]
struct Writer {
    announced: HashSet<u64>,
    seq: u64,
}

/// A receiver on this machine, or on another host (the link says which).
pub(crate) enum Flavor {
    /// Tensors cross as descriptors of memory the receiver maps (or copies the sender made).
    Local,
    /// Tensors cross as host bytes over the link or through NCCL: the communicators (used under
    /// the writer lock).
    Remote(Mutex<SendComms>),
}

/// One sender's connection to its receiver, shared by the clones of a `Sender`.
pub(crate) struct SenderInner {
    pub(crate) link: Link,
    flavor: Flavor,
    state: Mutex<SenderState>,
    changed: Condvar,
    /// Async sends waiting for what `changed` announces (credits, the greeting, the end).
    wakers: Mutex<Vec<std::task::Waker>>,
    writer: Mutex<Writer>,
    /// Chunks freed since the last write, to retire at the receiver before anything else.
    retired: Mutex<Vec<u64>>,
    me: std::sync::Weak<SenderInner>,
    /// How long a send without credits reads the socket itself before it sleeps, in ns.
    spin_ns: AtomicU64,
    /// The buffer a spinning send reads frames into.
    spin_buf: Mutex<Vec<u8>>,
}

impl RetireListener for SenderInner {
    fn retire(&self, chunk: u64) {
        lock(&self.retired).push(chunk);
        // Sent now if no message is being written (never waiting: this may run on the reader
        // thread, which must not block on a write), else before that message's next frame.
        if let Ok(mut writer) = self.writer.try_lock() {
            let _ = self.flush_retired(&mut writer, false);
        }
    }
}

impl SenderInner {
    /// Starts the connection's reader thread on `link`, whose `Hello` was sent.
    pub(crate) fn start(link: Link) -> Result<Arc<SenderInner>> {
        let flavor = if link.remote { Flavor::Remote(Mutex::new(SendComms::default())) } else { Flavor::Local };
        // What the reader thread waits on: the socket, registered once.
        let answers = PollSet::new()?;
        answers.add(link.fd(), 0)?;
        let inner = Arc::new_cyclic(|me| SenderInner {
            link,
            flavor,
            // No credits until the receiver's Hello says how many: until then the receiver is
            // not receiving, which is what a full queue means too.
            state: Mutex::new(SenderState::default()),
            changed: Condvar::new(),
            wakers: Mutex::new(Vec::new()),
            writer: Mutex::new(Writer::default()),
            retired: Mutex::new(Vec::new()),
            me: me.clone(),
            spin_ns: AtomicU64::new(0),
            spin_buf: Mutex::new(Vec::new()),
        });
        let reader = inner.clone();
        std::thread::Builder::new()
            .name("tq-sender-reader".into())
            .spawn(move || reader.read_answers(&answers))
            .map_err(|e| Error::Protocol(format!("spawning the reader thread: {e}")))?;
        Ok(inner)
    }

    /// For a receiver on another host, when the last `Sender` drops: NCCL sends still in flight
    /// finish first (bounded): the receiver may be setting up the connection they need, which
    /// must not look like a sender gone. Then the NCCL workers end here, on the user's thread: a
    /// program that returns from `main` next must not exit under a worker that is still inside
    /// NCCL.
    pub(crate) fn finish_remote(&self) {
        if let Flavor::Remote(comms) = &self.flavor {
            self.wait_released(network::NCCL_TIMEOUT);
            lock(comms).close();
        }
    }

    /// See [`Sender::outstanding_leases`](crate::Sender::outstanding_leases).
    pub(crate) fn outstanding_leases(&self) -> usize {
        let state = lock(&self.state);
        state.leases.len() + state.dropping
    }

    /// See [`Sender::wait_ready`](crate::Sender::wait_ready).
    pub(crate) fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let inner = self;
        let mut state = lock(&inner.state);
        loop {
            if let Some(refused) = &state.refused {
                return Err(Error::PeerRefused(refused.clone()));
            }
            if state.greeted {
                return Ok(());
            }
            if state.closed.is_some() {
                return Err(Error::Disconnected);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout);
            }
            state = inner.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// See [`Sender::set_spin`](crate::Sender::set_spin).
    pub(crate) fn set_spin(&self, spin: Duration) {
        self.spin_ns.store(spin.as_nanos().min(u64::MAX as u128) as u64, Atomic::Relaxed);
    }

    /// See [`Sender::is_connected`](crate::Sender::is_connected).
    pub(crate) fn is_connected(&self) -> bool {
        lock(&self.state).closed.is_none()
    }

    /// See [`Sender::take_rejected`](crate::Sender::take_rejected).
    pub(crate) fn take_rejected(&self) -> Vec<Rejection> {
        std::mem::take(&mut lock(&self.state).rejected)
    }

    /// The route a tensor on `source` takes to the receiver, once its `Hello` came.
    pub(crate) fn route(&self, source: &Uuid) -> Result<Choice> {
        let receiver = lock(&self.state).receiver.clone();
        let receiver = receiver.ok_or(Error::Disconnected)?;
        if matches!(self.flavor, Flavor::Remote(_)) {
            return Ok(route::choose_remote(source, &receiver.1, &receiver.0)?);
        }
        Ok(choose(source, &receiver.1, &receiver.0, Reach::local())?)
    }
}

/// A message's lease at a sender to another host, held by its NCCL transfers: it ends when the
/// last of them is done (or given up).
struct RemoteLease {
    sender: std::sync::Weak<SenderInner>,
    seq: u64,
}

impl Drop for RemoteLease {
    fn drop(&mut self) {
        if let Some(sender) = self.sender.upgrade() {
            lock(&sender.state).leases.remove(&self.seq);
            sender.changed.notify_all();
        }
    }
}

/// How long a send waits for room.
#[derive(Clone, Copy)]
pub(crate) enum Wait {
    Forever,
    Until(Instant),
    Never,
}

impl SenderInner {
    /// See [`Sender::wait_released`].
    pub(crate) fn wait_released(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.state);
        while !state.leases.is_empty() || state.dropping > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    /// Sends an encoded message to this receiver: takes a credit, then announces what the
    /// receiver has not seen yet and writes the message, leasing its tensors' storage.
    pub(crate) fn send_outgoing(&self, outgoing: &Outgoing, wait: Wait) -> Result<()> {
        self.take_credit(wait)?;
        self.send_credited(outgoing)
    }

    /// Gives back a credit taken by [`SenderInner::take_credit`] for a message not sent.
    pub(crate) fn return_credit(&self) {
        let mut state = lock(&self.state);
        state.credits += 1;
        state.uncredited -= 1;
        drop(state);
        self.changed.notify_all();
    }

    /// Writes `outgoing` for a credit already taken (given back if the write fails).
    pub(crate) fn send_credited(&self, outgoing: &Outgoing) -> Result<()> {
        let mut writer = lock(&self.writer);
        let seq = writer.seq + 1;
        let result = self.write_message(&mut writer, outgoing, seq);
        match result {
            Ok(event) => {
                writer.seq = seq;
                lock(&self.state).untaken.push_back(event);
                Ok(())
            }
            Err(error) => {
                let mut state = lock(&self.state);
                if matches!(error, Error::Disconnected) {
                    // A write found the receiver gone before the reader thread read the hang-up:
                    // from this answer on, `is_connected` agrees.
                    state.closed.get_or_insert_with(|| "the receiver is gone".into());
                }
                state.credits += 1;
                state.uncredited -= 1;
                let storage = state.leases.remove(&seq);
                drop(state);
                drop(writer);
                drop(storage); // may retire a user buffer's chunk, which takes the writer lock
                Err(error)
            }
        }
    }

    /// Waits for a credit (see [`Wait`]) and takes it.
    pub(crate) fn take_credit(&self, wait: Wait) -> Result<()> {
        let mut state = lock(&self.state);
        if state.credits == 0 && state.greeted && state.closed.is_none() && !matches!(wait, Wait::Never) {
            drop(state);
            self.spin_for_credits();
            state = lock(&self.state);
        }
        loop {
            if let Some(refused) = &state.refused {
                return Err(Error::PeerRefused(refused.clone()));
            }
            if state.closed.is_some() {
                return Err(Error::Disconnected);
            }
            if state.credits > 0 {
                state.credits -= 1;
                state.uncredited += 1;
                return Ok(());
            }
            state = match wait {
                Wait::Never => return Err(Error::Full),
                Wait::Forever => self.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
                Wait::Until(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout);
                    }
                    self.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
    }

    /// Writes one message (and the announcements it needs) under the writer lock; the event it
    /// recorded, if any.
    fn write_message(&self, writer: &mut Writer, outgoing: &Outgoing, seq: u64) -> Result<Option<EventSlot>> {
        if let Flavor::Remote(comms) = &self.flavor {
            self.write_remote(comms, outgoing, seq)?;
            return Ok(None);
        }
        self.flush_retired(writer, true)?;
        let (fence, event) = match &outgoing.fencing {
            Fencing::Done => (Fence::None, None),
            Fencing::Signal(signal) => {
                self.announce(writer, &signal.chunk)?;
                (Fence::Signal { chunk: signal.chunk.id, offset: signal.offset as u64, value: signal.value }, None)
            }
            Fencing::Event(stream) => {
                let slot = self.event_for(stream)?;
                (Fence::Event(slot.id), Some(slot))
            }
        };
        let give_back = |error: Error, event: Option<EventSlot>| {
            lock(&self.state).free_events.extend(event);
            error
        };
        // What each tensor becomes for this receiver (its route; copies queued now).
        let receiver = lock(&self.state).receiver.clone();
        let receiver = match receiver {
            Some(receiver) => receiver,
            None => return Err(give_back(Error::Disconnected, event)),
        };
        let sent =
            match crate::send::routes::prepare(&outgoing.tensors, outgoing.stream, &receiver, self.link.peer_pid()) {
                Ok(sent) => sent,
                Err(error) => return Err(give_back(error, event)),
            };
        let mut descriptors = Vec::with_capacity(sent.len());
        for (tensor, sent) in outgoing.tensors.iter().zip(&sent) {
            let storage = &sent.storage;
            let tensor_fence = match &sent.fence {
                Some(signal) => {
                    if let Err(error) = self.announce(writer, &signal.chunk) {
                        return Err(give_back(error, event));
                    }
                    Fence::Signal { chunk: signal.chunk.id, offset: signal.offset as u64, value: signal.value }
                }
                None if storage.chunk.device().is_some() => fence,
                None => Fence::None,
            };
            if let Err(error) = self.announce(writer, &storage.chunk) {
                return Err(give_back(error, event));
            }
            descriptors.push(TensorDesc {
                chunk: storage.chunk.id,
                storage_offset: storage.offset as u64,
                storage_len: storage.len as u64,
                view_offset: sent.view_offset as u64,
                dtype: tensor.dtype(),
                fence: tensor_fence,
                route: sent.route,
                target: sent.target,
                span: 0,
                shape: tensor.shape().to_vec(),
                strides: tensor.strides().to_vec(),
            });
        }
        {
            // Under the lock that handling a `Close` takes: either the closing is seen here, or
            // it sees this lease (and gives it back if the message was never read).
            let mut state = lock(&self.state);
            if state.closed.is_some() {
                drop(state);
                return Err(give_back(Error::Disconnected, event));
            }
            if !sent.is_empty() {
                state.leases.insert(seq, sent.into_iter().map(|s| s.storage).collect());
            }
        }
        let frame = Frame::Message {
            seq,
            sent_ns: outgoing.sent_ns,
            encoded_ns: crate::clock::monotonic_ns(),
            tensors: descriptors,
            payload: outgoing.payload.clone(),
        };
        match self.link.send(&frame, &[]) {
            Ok(()) => Ok(event),
            Err(error) => Err(give_back(error, event)),
        }
    }

    /// Writes one message to a receiver on another host: new communicators, the host tensors'
    /// bytes, and the message, whose GPU tensors NCCL moves (see `route/network.rs`). Nothing is
    /// leased: host bytes are copied, and NCCL's sources are held until their sends are done.
    fn write_remote(&self, comms: &Mutex<SendComms>, outgoing: &Outgoing, seq: u64) -> Result<()> {
        let receiver = lock(&self.state).receiver.clone().ok_or(Error::Disconnected)?;
        // The message is leased until its NCCL sends are done (nothing else is held: host bytes
        // are copied), so `wait_released` means the data has left this process.
        lock(&self.state).leases.insert(seq, Vec::new());
        let lease: Arc<dyn Send + Sync> = Arc::new(RemoteLease { sender: self.me.clone(), seq });
        let me = self.me.clone();
        let alive = move || me.upgrade().is_some_and(|inner| inner.link.gone().is_none());
        let mut message = {
            network::prepare(
                &outgoing.tensors,
                outgoing.stream,
                &receiver,
                &mut lock(comms),
                lease,
                &alive,
                self.link.liveness(),
            )?
        };
        let frame = Frame::Message {
            seq,
            sent_ns: outgoing.sent_ns,
            encoded_ns: crate::clock::monotonic_ns(),
            tensors: std::mem::take(&mut message.descriptors),
            payload: outgoing.payload.clone(),
        };
        // Sends never wait for the receiver (what the socket cannot take yet is queued): a
        // message begun is finished, or the receiver would join its leftover bytes to the next
        // message's.
        let mut begun = false;
        for frame in message.frames.iter().chain(std::iter::once(&frame)) {
            if let Err(error) = self.link.send(frame, &[]) {
                if !begun {
                    // Nothing of it was written: the receiver never heard of its communicators.
                    lock(comms).unwritten(message);
                }
                return Err(error);
            }
            begun = true;
        }
        // A communicator that failed leaves the receiver's receives of this message unpaired
        // (they would wait forever, or pair with a later message's sends): the connection ends,
        // so that both sides let their communicators go.
        message.written().inspect_err(|error| self.hang_up(&format!("an NCCL communicator failed: {error}")))
    }

    /// Sends the chunk's descriptor or handle the first time this peer needs it.
    fn announce(&self, writer: &mut Writer, chunk: &Chunk) -> Result<()> {
        if writer.announced.contains(&chunk.id) {
            return Ok(());
        }
        let device = chunk.device_uuid().unwrap_or_default().0;
        let (kind, legacy, fd) = match chunk.share()? {
            Shared::Fd(fd) if chunk.host().is_some() => (ChunkKind::Host, None, Some(fd)),
            Shared::Fd(fd) => (ChunkKind::Vmm, None, Some(fd)),
            Shared::Legacy(handle) => (ChunkKind::Legacy, Some(handle.to_bytes().to_vec()), None),
        };
        let frame =
            Frame::Chunk { id: chunk.id, len: chunk.len() as u64, kind, device, legacy, writable: chunk.writable };
        self.link.send(&frame, fd.as_slice())?;
        writer.announced.insert(chunk.id);
        // When the chunk goes (a user buffer freed, an idle arena chunk given back), the
        // receiver must drop its mapping: to free the memory, and since a user buffer's address
        // may be reused for other memory.
        let me: std::sync::Weak<dyn RetireListener> = self.me.clone();
        chunk.announced(me);
        Ok(())
    }

    /// Sends the retirements queued since the last write, waiting for room if `wait`, else
    /// keeping what does not fit for later.
    fn flush_retired(&self, writer: &mut Writer, wait: bool) -> Result<()> {
        let retired = std::mem::take(&mut *lock(&self.retired));
        let mut pending = retired.into_iter();
        while let Some(chunk) = pending.next() {
            writer.announced.remove(&chunk);
            let frame = Frame::Retire { chunk };
            let sent = if wait { self.link.send(&frame, &[]).map(|()| true) } else { self.link.try_send(&frame) };
            match sent {
                Ok(true) => {}
                Ok(false) => {
                    let mut retired = lock(&self.retired);
                    retired.push(chunk);
                    retired.extend(pending);
                    return Ok(());
                }
                Err(Error::Disconnected) => return Ok(()), // the receiver maps nothing any more
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// A pooled interprocess event, recorded on `stream` (a new one is announced first).
    fn event_for(&self, stream: &Stream) -> Result<EventSlot> {
        let pooled = lock(&self.state).free_events.pop();
        let slot = match pooled {
            Some(slot) => slot,
            None => {
                let event = Event::interprocess(stream.context())?;
                let id = {
                    let mut state = lock(&self.state);
                    state.next_event += 1;
                    state.next_event
                };
                let handle = event.export()?.to_bytes().to_vec();
                self.link.send(&Frame::Event { id, handle }, &[])?;
                EventSlot { id, event }
            }
        };
        if let Err(error) = slot.event.record(stream) {
            lock(&self.state).free_events.push(slot);
            return Err(error.into());
        }
        Ok(slot)
    }

    /// The reader thread: credits, releases, rejections and closings until the receiver hangs up.
    fn read_answers(self: Arc<Self>, answers: &PollSet) {
        let mut buf = vec![0u8; MAX_PACKET];
        let mut assembler = Assembler::default();
        let greeting = loop {
            match self.link.recv(answers, &mut assembler, &mut buf) {
                Ok(Read::Frame(Frame::Close { reason, .. }, _)) => {
                    break Err(Error::PeerRefused(Refusal::ByPeer(reason)));
                }
                Ok(Read::Frame(frame, _)) => break self.link.check_hello(frame),
                Ok(Read::Nothing) => continue,
                Ok(Read::HungUp) => break Err(Error::Disconnected),
                Err(error) => break Err(error),
            }
        };
        match greeting {
            Ok(greeting) => {
                let mut state = lock(&self.state);
                state.credits = greeting.capacity;
                state.greeted = true;
                state.receiver = Some(Arc::new((greeting.reach, greeting.routing)));
                drop(state);
                self.state_changed();
            }
            Err(error) => {
                tracing::warn!(%error, "the receiver's greeting failed");
                if let Error::PeerRefused(reason) = &error {
                    lock(&self.state).refused = Some(reason.clone());
                }
                return self.hang_up("the receiver's greeting failed");
            }
        }
        loop {
            match self.link.recv(answers, &mut assembler, &mut buf) {
                Ok(Read::Frame(frame, _)) => {
                    if !self.handle(frame) {
                        break;
                    }
                }
                Ok(Read::Nothing) => {}
                Ok(Read::HungUp) => break,
                Err(error) => {
                    tracing::warn!(%error, "closing the connection to the receiver");
                    break;
                }
            }
        }
        self.hang_up("the receiver hung up");
    }

    /// Reads the receiver's frames on the sending thread while no credit is left, for up to the
    /// spin time: the reader thread may take some of them too, which is fine, since credits add
    /// up and releases are independent of each other (and a receiver's frames are never parts).
    fn spin_for_credits(&self) {
        let spin = Duration::from_nanos(self.spin_ns.load(Atomic::Relaxed));
        if spin.is_zero() {
            return;
        }
        // One spinning thread is enough; others wait for it (or the reader thread) to see credits.
        let Ok(mut buf) = self.spin_buf.try_lock() else { return };
        let until = Instant::now() + spin;
        buf.resize(MAX_PACKET, 0);
        let mut assembler = Assembler::default();
        while Instant::now() < until && lock(&self.state).credits == 0 {
            match self.link.try_recv(&mut assembler, &mut buf).map(|(read, _)| read) {
                Ok(Read::Frame(frame, _)) => {
                    if !self.handle(frame) {
                        // The reader thread then reads the hang-up and returns the leases.
                        return self.link.shutdown(rustix::net::Shutdown::Both);
                    }
                }
                // A hang-up or an error: the reader thread sees it too and cleans up.
                Ok(Read::HungUp) | Err(_) => return,
                Ok(Read::Nothing) => std::hint::spin_loop(),
            }
        }
    }

    /// Handles a frame from the receiver. `false`: the frame was not one an honest receiver
    /// sends, and the connection must close.
    fn handle(&self, frame: Frame) -> bool {
        // Storage is dropped after the lock is let go: dropping a user buffer's chunk retires it.
        let mut released = Vec::new();
        let mut state = lock(&self.state);
        match frame {
            Frame::Release { messages } => {
                released.extend(messages.iter().filter_map(|seq| state.leases.remove(seq)));
            }
            Frame::Credit { count } => {
                if count > state.uncredited {
                    tracing::warn!(
                        count,
                        uncredited = state.uncredited,
                        "a receiver granted more than it may; closing"
                    );
                    return false;
                }
                state.credits += count;
                state.uncredited -= count;
                for _ in 0..count {
                    if let Some(Some(slot)) = state.untaken.pop_front() {
                        state.free_events.push(slot);
                    }
                }
            }
            Frame::Rejected { seq, reason } => {
                tracing::warn!(seq, %reason, "the receiver refused a message");
                released.extend(state.leases.remove(&seq));
                state.rejected.push(Rejection { seq, reason });
            }
            Frame::Close { read_up_to, reason } => {
                tracing::info!(%reason, "the receiver closed the channel");
                state.closed.get_or_insert(reason);
                // Messages it never read are ours again; those it read come back by release.
                let unread: Vec<u64> = state.leases.keys().copied().filter(|&seq| seq > read_up_to).collect();
                released.extend(unread.iter().filter_map(|seq| state.leases.remove(seq)));
            }
            other => {
                tracing::warn!(?other, "unexpected frame from a receiver; closing");
                return false;
            }
        }
        state.dropping += released.len();
        drop(state);
        let count = released.len();
        drop(released);
        lock(&self.state).dropping -= count;
        self.state_changed();
        true
    }

    /// The receiver's end is closed (its process is gone, or it released everything and let
    /// go): everything it held comes back now (dropped outside the lock).
    fn hang_up(&self, why: &str) {
        self.link.liveness().report(Gone::Closed(why.into()));
        self.link.shutdown(rustix::net::Shutdown::Both);
        if let Flavor::Remote(comms) = &self.flavor {
            lock(comms).abort();
        }
        let mut state: MutexGuard<'_, SenderState> = lock(&self.state);
        state.closed.get_or_insert_with(|| why.to_string());
        let released = std::mem::take(&mut state.leases);
        drop(state);
        drop(released);
        self.state_changed();
    }

    /// Wakes whoever waits for the state to change: blocked threads and async sends.
    fn state_changed(&self) {
        self.changed.notify_all();
        for waker in std::mem::take(&mut *lock(&self.wakers)) {
            waker.wake();
        }
    }

    /// Has `waker` woken at the next change of the state (the async send's wait for credit).
    #[cfg(feature = "tokio")]
    pub(crate) fn wake_on_change(&self, waker: &std::task::Waker) {
        let mut wakers = lock(&self.wakers);
        if !wakers.iter().any(|w| w.will_wake(waker)) {
            wakers.push(waker.clone());
        }
    }
}
