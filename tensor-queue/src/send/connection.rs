//! One sender's connection to its receiver, below the typed [`Sender`](crate::Sender): credits,
//! leases, announcements, the event pool, the thread that reads the receiver's answers, and the
//! hang-up. A receiver on this machine and one on another host are the two flavors ([`Flavor`]).
//!
//! Two locks, never nested the other way round: `state` (credits, leases, chunks announced,
//! events, what the receiver said) is only ever held briefly and never across a socket write, so the reader thread
//! can always take releases and credits, and `is_connected` or `outstanding_leases` never wait
//! for a blocked send; `writer` (announcements and sequence numbers) is held across the writes of
//! one message, so its frames reach the socket whole and in order.

use ipc_core::deadline::deadline;
use std::sync::atomic::{AtomicU64, Ordering as Atomic};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ipc_core::sync::CountedCondvar;
use ipc_core::{Event, Stream, Uuid};

use super::network::{self, SendComms};
use super::outgoing::{Fencing, Outgoing};
use super::protocol::{Lease, Rejection, SenderProtocol};
use super::routes::MappedFence;
use crate::error::{Error, Refusal, Result};
use crate::fences::liveness::Gone;
use crate::links::link::{Link, Read};
use crate::memory::arena::{Chunk, RetireListener, Shared};
use crate::route::{self, Choice, Reach, Routing, choose};
use crate::sync::lock;
use crate::tensor::Storage;
use crate::wire::{Answer, Assembler, ChunkKind, Fence, MAX_PACKET, ToReceiver, ToSender};

/// An interprocess event of one connection, exported once.
struct EventSlot {
    id: u32,
    event: Event,
}

#[derive(Default)]
struct SenderState {
    /// Credits, leases (the storage of each message's tensors), the events waiting for a
    /// credit, rejections and the closing (see `protocol.rs`).
    protocol: SenderProtocol<Vec<Arc<Storage>>, EventSlot>,
    /// The receiver's GPUs and routing policy, from its `Hello`.
    receiver: Option<Arc<(Reach, Routing)>>,
}

/// What only the thread writing a message touches.
#[derive(Default)]
struct Writer {
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
    /// Threads waiting for the state to change (the greeting, releases, the end).
    changed: CountedCondvar,
    /// Sends waiting for a credit: woken one per credit, each passing on what it leaves, and
    /// all at the end. (Waking all at each credit made a thousand threads sharing one `Sender`
    /// switch 195 times per message: outside tester, Rust round 10.)
    room: CountedCondvar,
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
    /// To a receiver on another host: a message whose GPU tensors total at most this many bytes
    /// sends them inline, without NCCL (`route/inline.rs`).
    inline_up_to: AtomicU64,
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
        // Before this process's first channel starts threads (`ipc_core::fd_passing`).
        ipc_core::fd_passing::reserve_table();
        let flavor = if link.remote { Flavor::Remote(Mutex::new(SendComms::default())) } else { Flavor::Local };
        let inner = Arc::new_cyclic(|me| SenderInner {
            link,
            flavor,
            // No credits until the receiver's Hello says how many: until then the receiver is
            // not receiving, which is what a full queue means too.
            state: Mutex::new(SenderState::default()),
            changed: CountedCondvar::new(),
            room: CountedCondvar::new(),
            wakers: Mutex::new(Vec::new()),
            writer: Mutex::new(Writer::default()),
            retired: Mutex::new(Vec::new()),
            me: me.clone(),
            spin_ns: AtomicU64::new(0),
            spin_buf: Mutex::new(Vec::new()),
            inline_up_to: AtomicU64::new(route::DEFAULT_INLINE_GPU_UP_TO),
        });
        let reader = inner.clone();
        std::thread::Builder::new()
            .name("tq-sender-reader".into())
            .spawn(move || reader.read_answers())
            .map_err(|source| ipc_core::Error::Os { what: "spawning the reader thread", source })?;
        Ok(inner)
    }

    /// For a receiver on another host, when the last `Sender` drops: messages still in flight
    /// (NCCL sends, host bytes not yet in the socket) finish first, within `timeout`: the
    /// receiver may be setting up the connection they need, which must not look like a sender
    /// gone. Then the NCCL workers end here, on the user's thread: a program that returns from
    /// `main` next must not exit under a worker that is still inside NCCL. A receiver that took
    /// nothing more for the whole wait has its communicators aborted, not closed (closing waits
    /// for their sends). The drop's one bound is `timeout`: the wait for the link's bytes that
    /// follows has only what is left of it.
    pub(crate) fn finish_remote(&self, timeout: Duration) {
        if let Flavor::Remote(comms) = &self.flavor {
            // Not under the lock: a receiver's hang-up takes it (`hang_up`) to end the wait.
            let released = self.wait_released(timeout);
            let mut comms = lock(comms);
            if !released {
                comms.abort();
            }
            comms.close();
        }
    }

    /// See [`Sender::has_room`](crate::Sender::has_room).
    pub(crate) fn has_credit(&self) -> bool {
        lock(&self.state).protocol.credits() > 0
    }

    /// See [`Sender::outstanding_leases`](crate::Sender::outstanding_leases).
    pub(crate) fn outstanding_leases(&self) -> usize {
        lock(&self.state).protocol.outstanding()
    }

    /// See [`Sender::wait_ready`](crate::Sender::wait_ready).
    pub(crate) fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = deadline(timeout);
        let inner = self;
        let mut state = lock(&inner.state);
        loop {
            if let Some(ended @ Error::PeerRefused(_)) = state.protocol.ended() {
                return Err(ended);
            }
            if state.protocol.is_greeted() {
                return Ok(());
            }
            if state.protocol.closed().is_some() {
                return Err(Error::Disconnected);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout);
            }
            state = inner.changed.wait_timeout(state, left);
        }
    }

    /// See [`Sender::set_spin`](crate::Sender::set_spin).
    pub(crate) fn set_spin(&self, spin: Duration) {
        self.spin_ns.store(spin.as_nanos().min(u64::MAX as u128) as u64, Atomic::Relaxed);
    }

    /// Sets the threshold of small messages' inline GPU tensors (checked by the caller).
    pub(crate) fn set_inline_up_to(&self, bytes: u64) {
        self.inline_up_to.store(bytes, Atomic::Relaxed);
    }

    /// The threshold of small messages' inline GPU tensors.
    pub(crate) fn inline_up_to(&self) -> u64 {
        self.inline_up_to.load(Atomic::Relaxed)
    }

    /// See [`Sender::is_connected`](crate::Sender::is_connected).
    pub(crate) fn is_connected(&self) -> bool {
        lock(&self.state).protocol.closed().is_none()
    }

    /// See [`Sender::take_rejected`](crate::Sender::take_rejected).
    pub(crate) fn take_rejected(&self) -> Vec<Rejection> {
        lock(&self.state).protocol.take_rejected()
    }

    /// The route a tensor on `source` takes to the receiver, once its `Hello` came, in a message
    /// whose GPU tensors total `gpu_bytes` (`None`: more than any threshold).
    pub(crate) fn route(&self, source: &Uuid, gpu_bytes: Option<u64>) -> Result<Choice> {
        let receiver = lock(&self.state).receiver.clone();
        let receiver = receiver.ok_or(Error::Disconnected)?;
        if matches!(self.flavor, Flavor::Remote(_)) {
            let choice = route::choose_remote(source, &receiver.1, &receiver.0)?;
            let small = gpu_bytes.is_some_and(|bytes| route::inlines(bytes, self.inline_up_to(), receiver.1.strict));
            return Ok(match choice.route {
                route::Route::Nccl if small => route::inline_choice(choice),
                _ => choice,
            });
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
            lock(&sender.state).protocol.remote_done(self.seq);
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
        let state = self.changed.wait_timeout_while(lock(&self.state), timeout, |s| s.protocol.outstanding() > 0);
        state.protocol.outstanding() == 0
    }

    /// Sends an encoded message to this receiver: takes a credit, then announces what the
    /// receiver has not seen yet and writes the message, leasing its tensors' storage.
    pub(crate) fn send_outgoing(&self, outgoing: &Outgoing, wait: Wait) -> Result<()> {
        self.take_credit(wait)?;
        self.send_credited(outgoing)
    }

    /// Gives back a credit taken by [`SenderInner::take_credit`] for a message not sent.
    pub(crate) fn return_credit(&self) {
        lock(&self.state).protocol.return_credit();
        self.changed.notify_all();
        self.room.notify_one();
    }

    /// Writes `outgoing` for a credit already taken (given back if the write fails).
    pub(crate) fn send_credited(&self, outgoing: &Outgoing) -> Result<()> {
        let mut writer = lock(&self.writer);
        let seq = writer.seq + 1;
        let result = self.write_message(&mut writer, outgoing, seq);
        match result {
            Ok(event) => {
                writer.seq = seq;
                self.link.accepted(seq);
                lock(&self.state).protocol.written(event);
                Ok(())
            }
            Err(error) => {
                // A write that found the receiver gone before the reader thread read the
                // hang-up: from this answer on, `is_connected` agrees.
                let gone = matches!(error, Error::Disconnected);
                let storage = lock(&self.state).protocol.unwritten(seq, gone);
                drop(writer);
                drop(storage); // may retire a user buffer's chunk, which takes the writer lock
                Err(error)
            }
        }
    }

    /// Waits for a credit (see [`Wait`]) and takes it.
    pub(crate) fn take_credit(&self, wait: Wait) -> Result<()> {
        let mut state = lock(&self.state);
        let protocol = &state.protocol;
        if protocol.credits() == 0
            && protocol.is_greeted()
            && protocol.ended().is_none()
            && !matches!(wait, Wait::Never)
        {
            drop(state);
            self.spin_for_credits(match wait {
                Wait::Until(deadline) => Some(deadline),
                Wait::Forever | Wait::Never => None,
            });
            state = lock(&self.state);
        }
        loop {
            if state.protocol.take_credit()? {
                if state.protocol.credits() > 0 {
                    self.room.notify_one(); // more than one came: the next waiter's
                }
                return Ok(());
            }
            state = match wait {
                Wait::Never => return Err(Error::Full),
                Wait::Forever => self.room.wait(state),
                Wait::Until(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout);
                    }
                    self.room.wait_timeout(state, left)
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
            Fencing::Done => (MappedFence::Now(Fence::None), None),
            // Queued, and its chunk announced, only if a tensor is mapped where it is.
            Fencing::Signal(signal) => (MappedFence::Signal(signal), None),
            Fencing::Event(stream) => {
                let slot = self.event_for(stream)?;
                (MappedFence::Now(Fence::Event(slot.id)), Some(slot))
            }
        };
        let give_back = |error: Error, event: Option<EventSlot>| {
            if let Some(event) = event {
                lock(&self.state).protocol.give_back_event(event);
            }
            error
        };
        // What each tensor becomes for this receiver (its route; copies queued now).
        let receiver = lock(&self.state).receiver.clone();
        let receiver = match receiver {
            Some(receiver) => receiver,
            None => return Err(give_back(Error::Disconnected, event)),
        };
        let pid = self.link.peer_pid();
        let prepared =
            crate::send::routes::prepare(&outgoing.tensors, &outgoing.touched, outgoing.stream, &receiver, pid, fence);
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(error) => return Err(give_back(error, event)),
        };
        for chunk in &prepared.chunks {
            if let Err(error) = self.announce(writer, chunk) {
                return Err(give_back(error, event));
            }
        }
        {
            // Under the lock that handling a `Close` takes: either the closing is seen here, or
            // it sees this lease (and gives it back if the message was never read).
            // A message without tensors holds no lease: the receiver releases none.
            let lease = (!outgoing.tensors.is_empty()).then(|| Lease::Held(prepared.leases));
            if let Err(error) = lock(&self.state).protocol.writing(seq, lease) {
                return Err(give_back(error, event));
            }
        }
        let frame = ToReceiver::Message {
            seq,
            sent_ns: outgoing.sent_ns,
            encoded_ns: crate::clock::monotonic_ns(),
            tensors: prepared.table,
            payload: outgoing.payload.clone(),
        };
        tracing::trace!(pid, seq, "send: the message");
        match self.link.send(&frame, &[]) {
            Ok(()) => Ok(event),
            Err(error) => Err(give_back(error, event)),
        }
    }

    /// Writes one message to a receiver on another host: new communicators, the host tensors'
    /// bytes, and the message, whose GPU tensors NCCL moves (see `send/network.rs`). The
    /// message is leased until its host bytes are in the socket (written straight from the
    /// tensors' memory) and its NCCL sends are done.
    fn write_remote(&self, comms: &Mutex<SendComms>, outgoing: &Outgoing, seq: u64) -> Result<()> {
        let receiver = lock(&self.state).receiver.clone().ok_or(Error::Disconnected)?;
        // The message is leased until its host bytes are written and its NCCL sends are done, so
        // `wait_released` means the data has left this process.
        lock(&self.state).protocol.writing(seq, Some(Lease::Remote))?;
        let lease: Arc<dyn Send + Sync> = Arc::new(RemoteLease { sender: self.me.clone(), seq });
        let me = self.me.clone();
        let alive = move || me.upgrade().is_some_and(|inner| inner.link.gone().is_none());
        let mut message = {
            network::prepare(
                &outgoing.tensors,
                &outgoing.touched,
                outgoing.stream,
                &receiver,
                self.inline_up_to(),
                &mut lock(comms),
                lease,
                &alive,
                self.link.liveness(),
            )?
        };
        let frame = ToReceiver::Message {
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
        for frame in &message.frames {
            if let Err(error) = self.link.send(frame, &[]) {
                if !begun {
                    // Nothing of it was written: the receiver never heard of its communicators.
                    lock(comms).unwritten(message);
                }
                return Err(error);
            }
            begun = true;
        }
        match message.bulk.take() {
            // The host bytes and their message in one write (see `Link::send_bulk_then`).
            Some(bulk) => {
                if let Err(error) = self.link.send_bulk_then(bulk, &frame) {
                    if !begun {
                        lock(comms).unwritten(message);
                    }
                    return Err(error);
                }
            }
            None => self.link.send(&frame, &[])?,
        }
        // A communicator that failed leaves the receiver's receives of this message unpaired
        // (they would wait forever, or pair with a later message's sends): the connection ends,
        // so that both sides let their communicators go.
        message.written().inspect_err(|error| self.hang_up(&format!("an NCCL communicator failed: {error}")))
    }

    /// Sends the chunk's descriptor or handle the first time this peer needs it (and again if
    /// the peer lost it: see `ToSender::ChunkLost`). Under the writer lock, which only the
    /// `&mut Writer` proves.
    fn announce(&self, _writer: &mut Writer, chunk: &Chunk) -> Result<()> {
        if !lock(&self.state).protocol.needs_announcing(chunk.id) {
            return Ok(());
        }
        let device = chunk.device_uuid().unwrap_or_default().0;
        let (kind, legacy, fd) = match chunk.share()? {
            Shared::Fd(fd) if chunk.host().is_some() => (ChunkKind::Host, None, Some(fd)),
            Shared::Fd(fd) => (ChunkKind::Vmm, None, Some(fd)),
            Shared::Legacy(handle) => (ChunkKind::Legacy, Some(handle.to_bytes().to_vec()), None),
        };
        let frame =
            ToReceiver::Chunk { id: chunk.id, len: chunk.len() as u64, kind, device, legacy, writable: chunk.writable };
        // Marked first: the receiver may say it lost the descriptor as soon as the frame is out.
        lock(&self.state).protocol.announcing(chunk.id);
        if let Err(error) = self.link.send(&frame, fd.as_slice()) {
            lock(&self.state).protocol.forget_chunk(chunk.id);
            return Err(error);
        }
        // When the chunk goes (a user buffer freed, an idle arena chunk given back), the
        // receiver must drop its mapping: to free the memory, and since a user buffer's address
        // may be reused for other memory.
        let me: std::sync::Weak<dyn RetireListener> = self.me.clone();
        chunk.announced(me);
        Ok(())
    }

    /// Sends the retirements queued since the last write, waiting for room if `wait`, else
    /// keeping what does not fit for later.
    fn flush_retired(&self, _writer: &mut Writer, wait: bool) -> Result<()> {
        let retired = std::mem::take(&mut *lock(&self.retired));
        let mut pending = retired.into_iter();
        while let Some(chunk) = pending.next() {
            lock(&self.state).protocol.forget_chunk(chunk);
            let frame = ToReceiver::Retire { chunk };
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
        let pooled = lock(&self.state).protocol.free_event();
        let slot = match pooled {
            Some(slot) => slot,
            None => {
                let event = Event::interprocess(stream.context())?;
                let id = lock(&self.state).protocol.new_event_id();
                let handle = event.export()?.to_bytes().to_vec();
                self.link.send(&ToReceiver::Event { id, handle }, &[])?;
                EventSlot { id, event }
            }
        };
        if let Err(error) = slot.event.record(stream) {
            lock(&self.state).protocol.give_back_event(slot);
            return Err(error.into());
        }
        Ok(slot)
    }

    /// The reader thread: credits, releases, rejections and closings until the receiver hangs up.
    fn read_answers(self: Arc<Self>) {
        let mut buf = vec![0u8; MAX_PACKET];
        let mut assembler = Assembler::default();
        let greeting = loop {
            match self.link.recv(&mut assembler, &mut buf) {
                Ok(Read::Frame(Answer::Refused { reason }, _)) => {
                    break Err(Error::PeerRefused(Refusal::ByPeer(reason)));
                }
                Ok(Read::Frame(Answer::Hello(hello), _)) => break self.link.check_hello(hello),
                Ok(Read::Nothing) => continue,
                Ok(Read::HungUp) => break Err(Error::Disconnected),
                // Bytes that are no greeting: something else listens there. (Said `Disconnected`,
                // as if a receiver had gone: outside tester, Python round 10.)
                Err(error @ (Error::Frame { .. } | Error::Violation(_))) => {
                    break Err(Error::PeerRefused(Refusal::NotAReceiver(error.to_string())));
                }
                Err(error) => break Err(error),
            }
        };
        match greeting {
            Ok(greeting) => {
                let mut state = lock(&self.state);
                state.protocol.greeted(greeting.capacity);
                state.receiver = Some(Arc::new((greeting.reach, greeting.routing)));
                drop(state);
                self.state_changed();
            }
            Err(error) => {
                tracing::warn!(%error, "the receiver's greeting failed");
                if let Error::PeerRefused(reason) = &error {
                    lock(&self.state).protocol.refused(reason.clone());
                }
                return self.hang_up("the receiver's greeting failed");
            }
        }
        loop {
            match self.link.recv(&mut assembler, &mut buf) {
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
    ///
    /// It spins no later than `deadline` (a `send_timeout`'s): a spin longer than the timeout
    /// held `send_timeout` for the whole spin (outside tester, Rust round 9, finding 3).
    fn spin_for_credits(&self, deadline: Option<Instant>) {
        let spin = Duration::from_nanos(self.spin_ns.load(Atomic::Relaxed));
        if spin.is_zero() {
            return;
        }
        // One spinning thread is enough; others wait for it (or the reader thread) to see credits.
        let Ok(mut buf) = self.spin_buf.try_lock() else { return };
        let spun = ipc_core::deadline::deadline(spin);
        let until = deadline.map_or(spun, |deadline| deadline.min(spun));
        buf.resize(MAX_PACKET, 0);
        let mut assembler = Assembler::default();
        while Instant::now() < until && lock(&self.state).protocol.credits() == 0 {
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
    /// sends at this point, and the connection must close.
    fn handle(&self, frame: ToSender) -> bool {
        if let ToSender::Rejected { seq, reason } = &frame {
            tracing::warn!(seq, %reason, "the receiver refused a message");
        }
        if let ToSender::Close { reason, .. } = &frame {
            tracing::info!(%reason, "the receiver closed the channel");
        }
        let mut state = lock(&self.state);
        let released = match state.protocol.on_frame(frame) {
            Ok(released) => released,
            Err(violation) => {
                tracing::warn!(%violation, "the receiver broke the protocol; closing");
                return false;
            }
        };
        // Storage is dropped after the lock is let go: dropping a user buffer's chunk retires it.
        let count = released.len();
        state.protocol.dropping(count);
        drop(state);
        drop(released);
        lock(&self.state).protocol.dropped(count);
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
        let released = state.protocol.hang_up(why);
        // Counted as outstanding until dropped, as in `handle`: `wait_released` must not return
        // while their storage (memory the pool counts in use) is still being dropped here.
        let count = released.len();
        state.protocol.dropping(count);
        drop(state);
        drop(released);
        lock(&self.state).protocol.dropped(count);
        self.state_changed();
    }

    /// Wakes whoever waits for the state to change: blocked threads (one send for credits, all
    /// at the end) and async sends.
    fn state_changed(&self) {
        self.changed.notify_all();
        let (credits, ended) = {
            let state = lock(&self.state);
            (state.protocol.credits(), state.protocol.ended().is_some())
        };
        if ended {
            self.room.notify_all();
        } else if credits > 0 {
            self.room.notify_one();
        }
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
