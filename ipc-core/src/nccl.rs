//! NCCL communicators between processes, one GPU each: the engine that will carry tensors
//! between hosts (design decision 10).
//!
//! | type | CPU idea it mirrors |
//! | --- | --- |
//! | [`UniqueId`] | a rendezvous address: one process makes it, the others receive it out of band |
//! | [`Communicator`] | a connected socket between ranks, whose sends and receives run on streams |
//!
//! # Failure policy
//! Every communicator is non-blocking (`blocking = 0`), so no call can hang on a dead peer: each
//! wait is a poll of `ncclCommGetAsyncError` bounded by the communicator's timeout. When NCCL
//! reports an error, or a wait runs out of time, the communicator is aborted at once
//! (`ncclCommAbort` also stops its kernels, so the streams they occupy drain), and every later
//! call returns [`Error::NcclAborted`]. `Drop` finalizes a healthy communicator (bounded by the
//! timeout) and then releases it with `ncclCommAbort`, which is local; `ncclCommDestroy` would
//! wait for every other rank, forever if one died (see `Drop`). What fails there is logged, as
//! for every type of this crate.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_sys::nccl::{Progress, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclResult_t, ncclUniqueId};
use cuda_sys::{nccl, nccl_nonblocking};

use crate::error::check_range;
use crate::{Context, DeviceMemory, Error, Result, Stream};

/// How long a wait runs before it asks the watch (see [`Communicator::watch`]): a peer that
/// closed its connection cleanly right after its last call has usually let NCCL finish by then.
const WATCH_GRACE: Duration = Duration::from_secs(1);

/// How long a wait for a communicator's background work asks NCCL again and again (yielding the
/// core between asks) before it sleeps between asks: a group of sends or receives is set up in
/// tens of microseconds, and the shortest sleep lasts the thread's timer slack (50 us by default)
/// on top of what it asked for.
const SPIN_FOR: Duration = Duration::from_micros(300);

/// The rendezvous of a communicator: made by one rank ([`UniqueId::new`]) and sent to the others
/// over a channel of the caller's choice; it holds the first rank's bootstrap address.
#[derive(Clone, Copy)]
pub struct UniqueId(ncclUniqueId);

impl UniqueId {
    /// Its size in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const LEN: usize = cuda_sys::nccl::NCCL_UNIQUE_ID_BYTES as usize;

    /// A fresh id (`ncclGetUniqueId`). It needs NCCL, but no GPU.
    pub fn new() -> Result<UniqueId> {
        let mut raw = ncclUniqueId::default();
        // SAFETY: `raw` is a valid out-pointer for the duration of the call.
        unsafe { nccl!(ncclGetUniqueId(&mut raw)) }?;
        Ok(UniqueId(raw))
    }

    /// The id received from another process.
    pub fn from_bytes(bytes: [u8; UniqueId::LEN]) -> UniqueId {
        UniqueId(ncclUniqueId { internal: bytes.map(|byte| byte as std::ffi::c_char) })
    }

    /// The bytes to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; UniqueId::LEN] {
        self.0.internal.map(|byte| byte as u8)
    }

    /// NCCL's form of the id.
    pub fn raw(&self) -> ncclUniqueId {
        self.0
    }
}

impl TryFrom<&[u8]> for UniqueId {
    type Error = Error;

    fn try_from(bytes: &[u8]) -> Result<UniqueId> {
        let bytes: [u8; UniqueId::LEN] = bytes.try_into().map_err(|_| {
            Error::MalformedHandle(format!("an NCCL unique id is {} bytes, not {}", UniqueId::LEN, bytes.len()))
        })?;
        Ok(UniqueId::from_bytes(bytes))
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let head: String = self.to_bytes()[..8].iter().map(|byte| format!("{byte:02x}")).collect();
        write!(f, "UniqueId({head}..)")
    }
}

/// One rank of an NCCL communicator, bound to the GPU of its context.
///
/// Sends and receives are queued on a [`Stream`] of that GPU, so they are ordered with the work
/// before and after them like any other stream work; [`Communicator::wait`] waits for a stream
/// while watching the communicator for errors. See the module's failure policy.
pub struct Communicator {
    /// Null once aborted.
    raw: Cell<ncclComm_t>,
    context: Arc<Context>,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// How many [`Communicator::group`] calls are open on this thread for this communicator.
    group_depth: Cell<u32>,
    /// Whether the other ranks still look alive (see [`Communicator::watch`]).
    alive: Option<Box<dyn Fn() -> bool + Send>>,
}

// SAFETY: an NCCL communicator is not tied to the thread that made it; NCCL lets any thread use
// it, one at a time. The handle moves with the context it was made in, and every method binds
// that context on the calling thread before calling NCCL.
unsafe impl Send for Communicator {}
// Not Sync, on purpose: NCCL does not allow calls on one communicator from two threads at once
// (its docs: communicators are not thread-safe), and the group depth and abort state are `Cell`s.

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.context.device().ordinal())
            .field("aborted", &self.raw.get().is_null())
            .finish()
    }
}

impl Communicator {
    /// Joins the communicator `id` as `rank` of `size`, on the GPU of `context`. Every rank
    /// must call this with the same id and size. Initialisation runs in the background
    /// (`ncclCommInitRankConfig` with `blocking = 0`) and is polled until it completes, fails,
    /// or `timeout` passes; on failure or timeout it is aborted. Later waits on this
    /// communicator are bounded by the same `timeout`.
    pub fn init(context: &Arc<Context>, id: &UniqueId, size: usize, rank: usize, timeout: Duration) -> Result<Self> {
        let communicator = Communicator::start(context, id, size, rank, timeout)?;
        communicator.wait_ready("initialisation")?;
        Ok(communicator)
    }

    /// [`Communicator::init`] without the wait: the communicator is returned while NCCL still
    /// sets it up in the background. Nothing may be queued on it before
    /// [`Communicator::check_async`] says [`Progress::Done`] (or [`Communicator::wait_until_ready`]
    /// returned).
    pub fn start(context: &Arc<Context>, id: &UniqueId, size: usize, rank: usize, timeout: Duration) -> Result<Self> {
        if rank >= size {
            return Err(Error::InvalidArgument(format!("NCCL rank {rank} of a communicator of {size}")));
        }
        let ranks = c_int::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("an NCCL communicator of {size} ranks")))?;
        context.bind()?;
        let mut config = ncclConfig_t::initializer();
        config.blocking = 0;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` and `config` are valid for the call (NCCL copies the config before it
        // returns); `rank < size`, both fit a c_int; the context of the GPU is current.
        let started =
            unsafe { nccl_nonblocking!(ncclCommInitRankConfig(&mut raw, ranks, id.0, rank as c_int, &mut config)) };
        let communicator = Communicator {
            raw: Cell::new(raw),
            context: context.clone(),
            rank,
            size,
            timeout,
            group_depth: Cell::new(0),
            alive: None,
        };
        if let Err(error) = started {
            return Err(communicator.fail(error.into()));
        }
        Ok(communicator)
    }

    /// Makes every wait of this communicator also ask `alive` (say, whether the control
    /// connection to the other rank is still open): once it says no, the communicator is aborted
    /// and the wait returns [`Error::PeerGone`], long before the timeout.
    pub fn watch(&mut self, alive: impl Fn() -> bool + Send + 'static) {
        self.alive = Some(Box::new(alive));
    }

    /// Whether the watch (if any) still sees the other ranks.
    fn peers_alive(&self) -> bool {
        self.alive.as_ref().is_none_or(|alive| alive())
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The bound on every wait of this communicator.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The context (GPU) of this rank.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Whether the communicator was aborted (after an error or a timeout).
    pub fn is_aborted(&self) -> bool {
        self.raw.get().is_null()
    }

    /// Queues a send of `len` bytes at `offset` of `memory` to rank `peer`, on `stream` (a
    /// stream of this communicator's GPU). The rank `peer` must queue the matching
    /// [`Communicator::recv`]. `memory` must stay alive until the stream has passed the send.
    pub fn send(
        &self,
        memory: &dyn DeviceMemory,
        offset: usize,
        len: usize,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.transfer(Direction::Send, memory, offset, len, peer, stream)
    }

    /// Queues a receive of `len` bytes into `offset` of `memory` from rank `peer`, on `stream`
    /// (a stream of this communicator's GPU). The bytes are there once the stream has passed it.
    pub fn recv(
        &self,
        memory: &dyn DeviceMemory,
        offset: usize,
        len: usize,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.transfer(Direction::Recv, memory, offset, len, peer, stream)
    }

    /// Runs `body` inside `ncclGroupStart` / `ncclGroupEnd`, so the sends and receives it queues
    /// on this communicator are issued together (and a send and a receive between the same two
    /// ranks cannot deadlock). Groups nest. Only this communicator is polled after the group, so
    /// queue nothing on another one inside it.
    pub fn group<R>(&self, body: impl FnOnce(&Communicator) -> Result<R>) -> Result<R> {
        self.live()?;
        self.context.bind()?;
        // SAFETY: no arguments; NCCL keeps the group state per thread.
        unsafe { nccl!(ncclGroupStart()) }?;
        self.group_depth.set(self.group_depth.get() + 1);
        let result = body(self);
        self.group_depth.set(self.group_depth.get() - 1);
        // SAFETY: closes the group opened above on this thread, whatever `body` did.
        let ended = unsafe { nccl_nonblocking!(ncclGroupEnd()) };
        let ended = self.after_call("ncclGroupEnd", ended);
        let value = result?;
        ended?;
        Ok(value)
    }

    /// Asks NCCL how the communicator's background work stands (`ncclCommGetAsyncError`):
    /// [`Progress::InProgress`] while an initialisation or a call is still being set up,
    /// [`Progress::Done`] otherwise. An error aborts the communicator and is returned.
    pub fn check_async(&self) -> Result<Progress> {
        let raw = self.live()?;
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is live; `state` is a valid out-pointer.
        if let Err(error) = unsafe { nccl!(ncclCommGetAsyncError(raw, &mut state)) } {
            return Err(self.fail(error.into()));
        }
        nccl::check_nonblocking("ncclCommGetAsyncError", Ok(state)).map_err(|error| self.fail(error.into()))
    }

    /// Waits until `stream` has finished its queued work, watching this communicator meanwhile:
    /// an error it reports, or the timeout passing first, aborts it (which also ends its kernels
    /// on the stream) and is returned.
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        let mut pause = Duration::from_micros(20);
        loop {
            if stream.is_idle()? {
                return Ok(());
            }
            self.check_async()?;
            if start.elapsed() > WATCH_GRACE && !self.peers_alive() {
                return Err(self.fail(Error::PeerGone));
            }
            if Instant::now() >= deadline {
                return Err(self.fail(Error::NcclTimeout { operation: "transfer", timeout: self.timeout }));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Aborts the communicator now (`ncclCommAbort`): its queued work is dropped and its kernels
    /// stop. The other ranks see an error or time out.
    pub fn abort(self) {
        self.abort_now();
    }

    /// The live handle, or [`Error::NcclAborted`].
    fn live(&self) -> Result<ncclComm_t> {
        let raw = self.raw.get();
        if raw.is_null() { Err(Error::NcclAborted) } else { Ok(raw) }
    }

    /// [`Communicator::send`] or [`Communicator::recv`]: checks the arguments (the range within
    /// `memory`, the peer's rank, the stream and the memory on this communicator's GPU), then
    /// queues the call.
    fn transfer(
        &self,
        direction: Direction,
        memory: &dyn DeviceMemory,
        offset: usize,
        len: usize,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        check_range(offset, len, memory.len())?;
        if peer >= self.size {
            return Err(Error::InvalidArgument(format!("NCCL peer {peer} of a communicator of {}", self.size)));
        }
        let device = self.context.device();
        for (what, other) in [("stream", stream.context().device()), ("memory", memory.context().device())] {
            if other != device {
                return Err(Error::InvalidArgument(format!(
                    "the {what} is on device {}, the communicator on device {}",
                    other.ordinal(),
                    device.ordinal()
                )));
            }
        }
        self.context.bind()?;
        let address = memory.device_ptr() + offset as u64;
        let peer = peer as c_int;
        let raw = self.live()?;
        let uint8 = ncclDataType_t::ncclUint8;
        // SAFETY (both): the range was checked against a live allocation of this communicator's
        // GPU, which the caller keeps alive until the stream has passed the call; `raw` is live.
        // A receive writes only that range.
        let (call, queued) = match direction {
            Direction::Send => {
                let sendbuff = address as *const c_void;
                // SAFETY: see above.
                ("ncclSend", unsafe { nccl_nonblocking!(ncclSend(sendbuff, len, uint8, peer, raw, stream.raw())) })
            }
            Direction::Recv => {
                let recvbuff = address as *mut c_void;
                // SAFETY: see above.
                ("ncclRecv", unsafe { nccl_nonblocking!(ncclRecv(recvbuff, len, uint8, peer, raw, stream.raw())) })
            }
        };
        self.after_call(call, queued)
    }

    /// After a call on the communicator: an error aborts it; `ncclInProgress` outside a group is
    /// waited out (inside one, `ncclGroupEnd` does that).
    fn after_call(&self, call: &'static str, outcome: std::result::Result<Progress, nccl::NcclError>) -> Result<()> {
        match outcome {
            Err(error) => Err(self.fail(error.into())),
            Ok(Progress::InProgress) if self.group_depth.get() == 0 => self.wait_ready(call),
            Ok(_) => Ok(()),
        }
    }

    /// Waits until a communicator made by [`Communicator::start`] is set up, within its timeout
    /// (then it is aborted, [`Error::NcclTimeout`]).
    pub fn wait_until_ready(&self) -> Result<()> {
        self.wait_ready("initialisation")
    }

    /// Polls until the background work of the communicator is done, within the timeout.
    fn wait_ready(&self, operation: &'static str) -> Result<()> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        let mut pause = Duration::from_micros(20);
        loop {
            if self.check_async()? == Progress::Done {
                return Ok(());
            }
            if start.elapsed() < SPIN_FOR {
                std::thread::yield_now();
                continue;
            }
            if start.elapsed() > WATCH_GRACE && !self.peers_alive() {
                return Err(self.fail(Error::PeerGone));
            }
            if Instant::now() >= deadline {
                return Err(self.fail(Error::NcclTimeout { operation, timeout: self.timeout }));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Aborts the communicator and gives back `error`.
    fn fail(&self, error: Error) -> Error {
        self.abort_now();
        error
    }

    fn abort_now(&self) {
        let raw = self.raw.replace(std::ptr::null_mut());
        if raw.is_null() {
            return;
        }
        let bound = self.context.bind();
        // SAFETY: `raw` was this communicator's live handle; it was replaced by null above, so it
        // is never used again. NCCL allows aborting at any point, initialisation included.
        let aborted = unsafe { nccl!(ncclCommAbort(raw)) };
        if let Err(error) = bound.and(aborted.map_err(Error::from)) {
            tracing::warn!(%error, "aborting an NCCL communicator failed");
        }
    }
}

/// Which way a transfer goes.
#[derive(Clone, Copy)]
enum Direction {
    /// From this rank's memory to the peer.
    Send,
    /// From the peer into this rank's memory.
    Recv,
}

impl Drop for Communicator {
    /// Finalizes (flushes queued operations, bounded by the timeout), then releases with
    /// `ncclCommAbort`, not `ncclCommDestroy`: on NCCL 2.28.3 `ncclCommDestroy` waits until every
    /// other rank destroys its communicator too, and forever when one has died (measured: two
    /// processes on two H200s, `one_rank_releasing_alone_is_bounded` in `tests/tests/nccl_gpu.rs`).
    /// Once finalized, nothing is left for an abort to cut short, and it releases locally.
    fn drop(&mut self) {
        let Ok(raw) = self.live() else { return };
        if let Err(error) = self.context.bind() {
            tracing::warn!(%error, "binding the context to release an NCCL communicator failed");
        }
        // SAFETY: `raw` is live; finalizing flushes its queued operations in the background.
        let finalizing = unsafe { nccl_nonblocking!(ncclCommFinalize(raw)) };
        // Any failure or timeout here aborts the communicator already (and clears `raw`).
        if let Err(error) = self.after_call("ncclCommFinalize", finalizing) {
            tracing::warn!(%error, "finalizing an NCCL communicator failed; it was aborted");
        }
        self.abort_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_round_trip_through_bytes() {
        let bytes: [u8; UniqueId::LEN] = std::array::from_fn(|i| (i * 7) as u8);
        let id = UniqueId::from_bytes(bytes);
        assert_eq!(id.to_bytes(), bytes);
        assert_eq!(UniqueId::try_from(&bytes[..]).map(|id| id.to_bytes()).ok(), Some(bytes));
        assert_eq!(UniqueId::LEN, 128);
        assert!(format!("{id:?}").starts_with("UniqueId(00070e15"));
    }

    #[test]
    fn an_id_of_the_wrong_length_is_refused() {
        let error = UniqueId::try_from(&[0u8; 64][..]).expect_err("too short");
        assert!(matches!(error, Error::MalformedHandle(_)), "{error:?}");
        assert!(error.to_string().contains("128 bytes, not 64"), "{error}");
    }
}
