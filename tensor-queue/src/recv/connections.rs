//! The set of a receiver's connections that the thread calling `recv` polls: it adopts what the
//! accept thread hands over, waits on the sockets, the accept doorbell and the NCCL workers'
//! wake-up, reads one frame per readable connection, parks messages whose host-route data is not
//! there yet, and keeps the errors of lost connections for `take_errors`. Below the typed
//! [`Receiver`](crate::Receiver), which decodes what [`Connections::next`] returns.

use std::collections::VecDeque;
use std::os::fd::{AsFd as _, BorrowedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::acceptor::{Acceptor, keep_bounded};
use super::connection::{Arrival, Connected, Progress, Ready, UNFINISHED_IDLE};
use super::devices::Devices;
use super::peer::Peer;
use super::readiness::{PENDING, Readiness};
use crate::clock::monotonic_ns;
use crate::error::{Error, Result};
use crate::fences::liveness::Gone;
use crate::links::link::Link;
use crate::links::poll::Waited;
use crate::route::Routing;
use crate::sync::lock;
use crate::wire::MAX_PACKET;

/// How long `recv` naps between looks at parked messages (without spinning).
const PARKED_POLL: Duration = Duration::from_micros(20);

/// The token of the NCCL workers' wake-up in the receiver's poll set.
const WAKE: u64 = PENDING + 1;
/// The token of the accept thread's doorbell.
const DOORBELL: u64 = PENDING + 2;

/// The token of a connection's socket: after the others (connection numbers start at 1).
fn token(connected: &Connected) -> u64 {
    DOORBELL + connected.peer.connection
}

/// A receiver's connections and what was read from them but not yet taken.
pub(crate) struct Connections {
    acceptor: Option<Acceptor>,
    connected: Vec<Connected>,
    arrivals: VecDeque<Arrival>,
    /// Messages whose host-route data is not there yet (see `must_park`).
    parked: VecDeque<Ready>,
    devices: Devices,
    capacity: u32,
    /// For `take_errors`, the last [`MAX_ERRORS_KEPT`](super::acceptor::MAX_ERRORS_KEPT).
    errors: VecDeque<Error>,
    /// How many senders have said hello.
    joined: usize,
    /// After how many senders no more may join (see `expect_senders`).
    expected: Option<usize>,
    /// How long `next` polls without sleeping before it blocks (zero: it blocks at once).
    spin: Duration,
    buf: Vec<u8>,
    /// Readable whenever `next` may make progress; what `pump` waits on.
    readiness: Readiness,
    /// The tokens a wait found (kept to reuse the allocation).
    tokens: Vec<u64>,
    /// Whether the next `pump` polls before it reads rung rings (see `pump`).
    poll_first: bool,
}

impl Connections {
    /// No connection yet; each sender may have `capacity` messages not yet received.
    pub fn new(capacity: u32, routing: Routing) -> Result<Connections> {
        // Before this receiver's threads and descriptors (`ipc_core::fd_passing`).
        ipc_core::fd_passing::reserve_table();
        let devices = Devices::new(routing)?;
        let readiness = Readiness::new()?;
        readiness.watch(devices.nccl_wake.fd(), WAKE)?;
        Ok(Connections {
            acceptor: None,
            connected: Vec::new(),
            arrivals: VecDeque::new(),
            parked: VecDeque::new(),
            devices,
            capacity,
            errors: VecDeque::new(),
            joined: 0,
            expected: None,
            spin: Duration::ZERO,
            buf: vec![0; MAX_PACKET],
            readiness,
            tokens: Vec::new(),
            poll_first: false,
        })
    }

    /// Takes the connections `acceptor` hands over from now on.
    pub fn accept_from(&mut self, acceptor: Acceptor) -> Result<()> {
        self.readiness.watch(acceptor.doorbell.as_fd(), DOORBELL)?;
        self.acceptor = Some(acceptor);
        Ok(())
    }

    /// Adds a connection already greeted.
    pub fn adopt(&mut self, link: Link) -> Result<()> {
        let connected = Connected::new(link);
        // The socket and the ring's doorbell themselves, not the link's poll set: a wake-up
        // crosses one level of epoll, not two.
        for fd in connected.peer.link.wake_fds() {
            self.readiness.watch(fd, token(&connected))?;
        }
        self.connected.push(connected);
        Ok(())
    }

    /// Takes a connection's descriptors out of the poll set (it may live on for the releases
    /// of tensors still held, and must not wake `recv` any more).
    fn unwatch(&self, gone: &Connected) {
        for fd in gone.peer.link.wake_fds() {
            self.readiness.forget(fd);
        }
    }

    /// Stops taking connections from the acceptor (which stops, and the socket file goes).
    fn drop_acceptor(&mut self) {
        if let Some(acceptor) = self.acceptor.take() {
            self.readiness.forget(acceptor.doorbell.as_fd());
        }
    }

    /// The socket file, for a receiver bound to a Unix socket.
    pub fn path(&self) -> Option<&Path> {
        self.acceptor.as_ref().and_then(Acceptor::path)
    }

    /// The address, for a receiver bound to TCP.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.acceptor.as_ref().and_then(Acceptor::local_addr)
    }

    pub fn routing(&self) -> &Routing {
        &self.devices.routing
    }

    /// The receiver's devices and streams.
    pub fn devices(&self) -> &Devices {
        &self.devices
    }

    /// See [`Receiver::set_spin`](crate::Receiver::set_spin).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// See [`Receiver::expect_senders`](crate::Receiver::expect_senders).
    pub fn expect_senders(&mut self, count: usize) {
        self.expected = Some(count);
        if let Some(acceptor) = &self.acceptor {
            lock(&acceptor.handed).limit = Some(count);
        }
        self.note_pending(); // `expect_senders(0)` (or a count already reached) ends the stream
    }

    /// Notes an error for `take_errors`.
    pub fn report(&mut self, error: Error) {
        keep_bounded(&mut self.errors, error);
    }

    /// The descriptor that is readable whenever `next` may make progress.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.readiness.fd()
    }

    /// Whether work inside the process waits for `recv` (see `readiness.rs`): messages read but
    /// not taken, packets a TCP link read ahead, parked messages, or the end of the stream.
    pub fn note_pending(&mut self) {
        let pending = !self.arrivals.is_empty()
            || !self.parked.is_empty()
            || self.connected.iter().any(|c| c.peer.link.has_buffered())
            || self.at_end();
        self.readiness.set_pending(pending);
    }

    /// Whether `recv` returns [`Error::Disconnected`] now, with nothing left to read. Not while
    /// the accept thread holds a connection it greeted (or is greeting): its sender may have
    /// sent, and is connected.
    fn at_end(&self) -> bool {
        let all_joined = self.expected.map_or(self.joined > 0, |n| self.joined >= n);
        self.connected.is_empty()
            && self.parked.is_empty()
            && (all_joined || self.acceptor.is_none())
            && !self.acceptor.as_ref().is_some_and(Acceptor::handing_over)
    }

    /// The next message ready to decode, waiting up to `timeout` (forever with `None`), counted
    /// as taken; [`Error::Rejected`] and [`Error::ProducerFailed`] for a message that cannot be
    /// used, [`Error::Disconnected`] at the end of the stream, [`Error::Timeout`] when none came
    /// within `timeout`, even a zero one (`try_recv` says [`Error::Empty`] for it).
    ///
    /// Before it first sleeps until an NCCL worker has queued a parked message's receives (the
    /// longest wait of a message from another host), it hands that message to `ahead`, which may
    /// decode a copy of it meanwhile (see `Receiver::recv_with_info`).
    pub fn next(&mut self, timeout: Option<Duration>, ahead: &mut dyn FnMut(&Ready)) -> Result<Ready> {
        let deadline = timeout.map(ipc_core::deadline::deadline); // `Duration::MAX` waits without end
        let mut looked_ahead = false;
        loop {
            if let Some(ready) = self.unpark()? {
                return self.take(ready);
            }
            match self.arrivals.pop_front() {
                Some(Arrival::Ready(ready)) if self.must_park(&ready)? => {
                    self.parked.push_back(ready);
                    continue;
                }
                Some(Arrival::Ready(ready)) => return self.take(ready),
                Some(Arrival::Rejected { pid, connection, seq, reason }) => {
                    return Err(Error::Rejected { pid, connection, seq, reason });
                }
                None => {}
            }
            if self.at_end() {
                // Connections the accept thread already took may be waiting at the doorbell.
                if self.acceptor.is_some() && self.pump(Some(Duration::ZERO))? {
                    continue;
                }
                return Err(Error::Disconnected);
            }
            let expired = deadline.is_some_and(|d| Instant::now() >= d);
            if !self.parked.is_empty() {
                // Parked messages wait for words that GPUs write, which wake nobody: read the
                // sockets without sleeping, then spin (if asked to) or nap briefly, and look again.
                if self.pump(Some(Duration::ZERO))? {
                    continue;
                }
                if expired {
                    return Err(Error::Timeout);
                }
                if self.parked.iter().all(|p| p.fences.iter().all(|f| f.wakes_receiver())) {
                    if let Some(first) = self.parked.front().filter(|_| !looked_ahead) {
                        ahead(first);
                        looked_ahead = true;
                        continue; // what came meanwhile is looked at before sleeping
                    }
                    // NCCL workers ring when they have issued a message's receives: block.
                    let wait = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                    self.pump(wait)?;
                } else if self.spin.is_zero() {
                    std::thread::sleep(PARKED_POLL);
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            if !self.spin.is_zero() && timeout != Some(Duration::ZERO) && self.spin_until_readable(deadline)? {
                continue;
            }
            let wait = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if !self.pump(wait)? {
                return Err(Error::Timeout);
            }
        }
    }

    /// Counts `ready` as taken by `recv` (its sender may send another), or says its producer
    /// failed.
    fn take(&mut self, mut ready: Ready) -> Result<Ready> {
        ready.info.taken_ns = monotonic_ns();
        if let Some(connected) = self.connected.iter_mut().find(|c| Arc::ptr_eq(&c.peer, &ready.peer)) {
            connected.took(self.capacity);
        }
        // Asked now, not when the message was read: the producer may have died since. The
        // message's tensors share these fences, and with them the answer.
        if crate::fences::failed(&ready.fences) {
            let info = &ready.info;
            return Err(Error::ProducerFailed { pid: info.sender_pid, connection: info.connection, seq: info.seq });
        }
        Ok(ready)
    }

    /// Whether `ready` must wait: its host-route tensors' data is not there yet, or an earlier
    /// message of its sender waits (each sender's messages are delivered in order).
    fn must_park(&self, ready: &Ready) -> Result<bool> {
        Ok(self.parked.iter().any(|p| Arc::ptr_eq(&p.peer, &ready.peer)) || !on_cpu_ready(ready)?)
    }

    /// The first parked message whose data is there, unless an earlier one of its sender waits.
    fn unpark(&mut self) -> Result<Option<Ready>> {
        let mut waiting: Vec<&Arc<Peer>> = Vec::new();
        let mut found = None;
        for (at, ready) in self.parked.iter().enumerate() {
            if waiting.iter().any(|p| Arc::ptr_eq(p, &ready.peer)) {
                continue;
            }
            if on_cpu_ready(ready)? {
                found = Some(at);
                break;
            }
            waiting.push(&ready.peer);
        }
        Ok(found.and_then(|at| self.parked.remove(at)))
    }

    /// See [`Receiver::stop_accepting`](crate::Receiver::stop_accepting).
    pub fn stop_accepting(&mut self) -> Result<()> {
        // The thread stops first, then every connection it accepted (and greeted: their senders
        // may already be sending) is taken from the doorbell; dropped, they would be lost.
        if let Some(acceptor) = &mut self.acceptor {
            acceptor.stop();
        }
        while self.accept_waiting()? {}
        self.drop_acceptor();
        self.note_pending();
        Ok(())
    }

    /// See [`Receiver::take_errors`](crate::Receiver::take_errors).
    pub fn take_errors(&mut self) -> Vec<Error> {
        if self.arrivals.is_empty() {
            // Read what is waiting, so errors of frames already sent are seen.
            let _ = self.pump(Some(Duration::ZERO));
            self.note_pending();
        }
        std::mem::take(&mut self.errors).into()
    }

    /// Looks for frames without sleeping for up to the spin time (or until `deadline`); whether
    /// anything was read.
    fn spin_until_readable(&mut self, deadline: Option<Instant>) -> Result<bool> {
        // `ipc_core::deadline`: a spin of `Duration::MAX` overflowed the clock here (a panic;
        // outside tester, Rust round 9, finding 4).
        let spun = ipc_core::deadline::deadline(self.spin);
        let until = deadline.map_or(spun, |deadline| deadline.min(spun));
        loop {
            // A non-blocking read per connection: one system call per frame, where a zero-timeout
            // `poll` and then the read would be two.
            if self.read_connections(0..self.connected.len()) || self.accept_waiting()? {
                return Ok(true);
            }
            if Instant::now() >= until {
                return Ok(false);
            }
            std::hint::spin_loop();
        }
    }

    /// Waits up to `wait` (forever with `None`) for sockets to become readable and reads one frame
    /// from each that is. Returns whether anything was readable.
    fn pump(&mut self, wait: Option<Duration>) -> Result<bool> {
        // Packets a TCP link read ahead wait in this process, where `poll` cannot see them.
        let buffered: Vec<usize> =
            (0..self.connected.len()).filter(|&i| self.connected[i].peer.link.has_buffered()).collect();
        if !buffered.is_empty() {
            self.read_connections(buffered);
            return Ok(true);
        }
        // A ring that may hold records keeps its link readable until it is found empty, so a
        // poll now would return at once: those links are read first, and the poll sleeps only
        // if they had nothing (one system call a message saved). After a frame read so, the
        // next call polls first, so that a ring that keeps coming never starves the others.
        if !std::mem::take(&mut self.poll_first) {
            let rung: Vec<usize> =
                (0..self.connected.len()).filter(|&i| self.connected[i].peer.link.ring_rung()).collect();
            if !rung.is_empty() && self.read_connections(rung) {
                self.poll_first = true;
                return Ok(true);
            }
        }
        // An unfinished message is given up once idle too long: the wait ends by then.
        let give_up = self.connected.iter().filter_map(Connected::unfinished_deadline).min();
        let until_give_up = give_up.map(|at| at.saturating_duration_since(Instant::now()));
        let capped = until_give_up.filter(|&left| wait.is_none_or(|wait| left < wait));
        let mut tokens = std::mem::take(&mut self.tokens);
        let waited = self.readiness.wait(&mut tokens, capped.or(wait));
        tracing::trace!(?waited, ?tokens, "recv: woke");
        let found = waited.map(|waited| self.ready(waited, &tokens));
        self.tokens = tokens;
        let (listener_ready, readable) = match found? {
            Some(found) => found,
            None if capped.is_some() => {
                self.give_up_idle();
                return Ok(true);
            }
            None => return Ok(false),
        };
        self.read_connections(readable);
        self.give_up_idle();
        if listener_ready {
            self.accept_waiting()?;
        }
        Ok(true)
    }

    /// What a wait found: whether the doorbell rang, and the indexes of the connections that
    /// are readable, in order (an interruption finds nothing); `None` if it timed out.
    fn ready(&self, waited: Waited, tokens: &[u64]) -> Option<(bool, Vec<usize>)> {
        match waited {
            Waited::TimedOut => return None,
            Waited::Interrupted => return Some((false, Vec::new())),
            Waited::Ready => {}
        }
        let mut listener_ready = false;
        let mut readable = Vec::with_capacity(tokens.len());
        for &token in tokens {
            match token {
                // An NCCL worker issued a parked message's receives: `recv` looks at it again.
                WAKE => self.devices.nccl_wake.drain(),
                DOORBELL => listener_ready = self.acceptor.is_some(),
                token => readable.extend(self.connected.iter().position(|c| self::token(c) == token)),
            }
        }
        // A connection's socket and doorbell share its token: read it once.
        readable.sort_unstable();
        readable.dedup();
        Some((listener_ready, readable))
    }

    /// Closes the connections whose unfinished message got no new byte for `UNFINISHED_IDLE`
    /// (what they hold goes), and reports each.
    fn give_up_idle(&mut self) {
        let now = Instant::now();
        let mut at = 0;
        while at < self.connected.len() {
            let connected = &self.connected[at];
            if connected.unfinished_deadline().is_none_or(|deadline| deadline > now) {
                at += 1;
                continue;
            }
            let why = format!("nothing more of it came for {UNFINISHED_IDLE:?}");
            // Past its deadline, a connection holds an unfinished message: `lost` says so.
            let lost =
                connected.lost(&why).unwrap_or_else(|| Error::internal(format_args!("idle, yet nothing held: {why}")));
            tracing::warn!(pid = connected.pid(), %lost, "closing a connection");
            connected.close(format!("the receiver closed the connection: {lost}"));
            keep_bounded(&mut self.errors, Error::ConnectionClosed { pid: connected.pid(), cause: Box::new(lost) });
            let gone = self.connected.remove(at);
            self.unwatch(&gone);
        }
    }

    /// Reads the next frame, if one is waiting, of each of these connections; closes those that
    /// hung up or sent something wrong. Whether any frame or hang-up was read.
    fn read_connections(&mut self, indexes: impl IntoIterator<Item = usize>) -> bool {
        let mut read = false;
        let mut closed = Vec::new();
        for index in indexes {
            let connected = &mut self.connected[index];
            match connected.read(&mut self.buf, &self.devices, self.capacity) {
                Ok(Progress::Idle) => {}
                Ok(Progress::Handled) => read = true,
                Ok(Progress::Greeted) => {
                    read = true;
                    self.joined += 1;
                }
                Ok(Progress::Arrived(arrival)) => {
                    read = true;
                    if let Arrival::Rejected { pid, connection, seq, reason } = &arrival {
                        let (pid, connection, seq, reason) = (*pid, *connection, *seq, reason.clone());
                        keep_bounded(&mut self.errors, Error::Rejected { pid, connection, seq, reason });
                    }
                    self.arrivals.push_back(arrival);
                }
                Ok(Progress::HungUp) => {
                    // A sender that left in the middle of a message, or with messages it had
                    // accepted and not written, lost them: say so, so that a death is not taken
                    // for a clean goodbye.
                    // Why, as its liveness says (the hang-up, or its process found dead).
                    let gone = connected.peer.link.gone().unwrap_or(Gone::HungUp);
                    if let Some(lost) = connected.lost(&format!("the sender {gone}")) {
                        keep_bounded(
                            &mut self.errors,
                            Error::ConnectionClosed { pid: connected.pid(), cause: Box::new(lost) },
                        );
                    }
                    closed.push(index);
                }
                Err(error) => {
                    tracing::warn!(pid = connected.pid(), %error, "closing a connection");
                    connected.close(format!("the receiver closed the connection: {error}"));
                    keep_bounded(
                        &mut self.errors,
                        Error::ConnectionClosed { pid: connected.pid(), cause: Box::new(error) },
                    );
                    closed.push(index);
                }
            }
        }
        read |= !closed.is_empty();
        for index in closed.into_iter().rev() {
            // Tensors received from it keep its socket open for their releases.
            let gone = self.connected.remove(index);
            self.unwatch(&gone);
        }
        if self.expected.is_some_and(|n| self.joined >= n) && self.acceptor.is_some() {
            // Every expected sender is here: no more join (and the socket file goes).
            self.drop_acceptor();
        }
        read
    }

    /// Adopts the connections the accept thread handed over, if any are waiting. Whether there
    /// were any.
    fn accept_waiting(&mut self) -> Result<bool> {
        let Some(acceptor) = &self.acceptor else { return Ok(false) };
        let Some((n, _)) = acceptor.doorbell.try_recv(&mut [0u8; 1])? else { return Ok(false) };
        // The links and the refusals only: the count of those being greeted stays the thread's.
        let (links, refused) = {
            let mut handed = lock(&acceptor.handed);
            (std::mem::take(&mut handed.links), std::mem::take(&mut handed.refused))
        };
        for error in refused {
            keep_bounded(&mut self.errors, error);
        }
        for link in links {
            self.adopt(link)?;
        }
        // 0: the accept thread has ended (`stop_accepting`): nothing more comes.
        Ok(n > 0)
    }
}

/// Whether every host word `ready` waits for on the CPU was written (or its producer died).
fn on_cpu_ready(ready: &Ready) -> Result<bool> {
    if !ready.on_cpu {
        return Ok(true);
    }
    for fence in ready.fences.iter() {
        if !fence.ready_on_cpu()? {
            return Ok(false);
        }
    }
    Ok(true)
}

impl Drop for Connections {
    fn drop(&mut self) {
        // Senders hear that no more messages are taken (a blocked send returns at once); the
        // sockets stay open for the releases of tensors still held.
        for connected in &self.connected {
            connected.close("the receiver was dropped".into());
        }
        // The NCCL workers of senders on other hosts give up, and end here, on the user's thread:
        // a program that returns from `main` next must not exit under a worker still inside NCCL.
        for connected in &mut self.connected {
            connected.abandon();
        }
        self.connected.clear();
        self.devices.nccl_workers.join();
    }
}
