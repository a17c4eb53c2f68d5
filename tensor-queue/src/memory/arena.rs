//! Where sendable tensors live: chunks of shareable memory, each exported at most once.
//!
//! Exporting costs 0.7 ms (VMM) and opening 53-129 us, so tensors are not allocated one by one:
//! they are carved out of large chunks (64 MiB, or one chunk for a larger tensor). A chunk is
//! announced to each peer once, with its descriptor; afterwards a message names only
//! (chunk, offset, length). Freed space is reused at once.
//!
//! # Giving memory back
//! A chunk with no live allocation is kept for reuse for [`idle_release`](crate::memory) (one
//! second by default) and then goes back to the driver or the kernel; [`crate::memory::trim`]
//! gives back every such chunk at once. When a chunk goes, every peer it was announced to is told
//! (`Retire`) so that it drops its mapping too: VMM memory is freed only when no process maps it.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ipc_core::{
    Context, DeviceBuffer, DeviceMemory, Event, ImportedIpcMemory, IpcMemHandle, SharedMemory, Uuid, VmmAllocation,
};

use crate::error::{Error, Result};
use crate::sync::lock;

/// The default chunk size.
pub const CHUNK_BYTES: usize = 64 << 20;
/// Every allocation starts at a multiple of this (enough for any dtype and vector loads).
pub const ALIGNMENT: usize = 512;

/// The memory behind a chunk.
pub(crate) enum ChunkMemory {
    /// A shared-memory file of this process.
    Host(SharedMemory),
    /// VMM device memory of this process, exportable as a descriptor.
    Vmm(VmmAllocation),
    /// A `cuMemAlloc` buffer the user made, shared through a legacy IPC handle.
    Legacy(Arc<DeviceBuffer>),
    /// Another process's shared-memory file, mapped here.
    ImportedHost(SharedMemory),
    /// Another process's VMM memory, mapped here.
    ImportedVmm(VmmAllocation),
    /// Another process's `cuMemAlloc` buffer, opened here.
    ImportedLegacy(ImportedIpcMemory),
}

/// A range of shareable memory with a process-unique id (chunks received from a peer get one of
/// this process too: the peer's own id is only a key in that connection's table).
pub(crate) struct Chunk {
    pub id: u64,
    pub memory: ChunkMemory,
    /// Host chunks: whether peers may write it (else they are sent a read-only descriptor).
    pub writable: bool,
    /// The device's UUID for device chunks, asked of the driver once (it is on every hand-off's path).
    device_uuid: Option<Uuid>,
    /// The descriptor peers get (a VMM export, or a read-only reopening of a host file), made on
    /// the first announcement and reused for every later peer.
    exported: OnceLock<OwnedFd>,
    /// Peers this chunk was announced to, told to forget it when it is freed.
    announced_to: Mutex<Vec<std::sync::Weak<dyn RetireListener>>>,
    /// Other devices (by ordinal) granted access to this device chunk (see [`Chunk::grant_access`]).
    granted: Mutex<Vec<i32>>,
}

/// A connection that must hear when a chunk it announced is freed.
pub(crate) trait RetireListener: Send + Sync {
    fn retire(&self, chunk: u64);
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let peers = std::mem::take(&mut *lock(&self.announced_to));
        for peer in peers.iter().filter_map(std::sync::Weak::upgrade) {
            peer.retire(self.id);
        }
    }
}

impl Chunk {
    pub fn new(memory: ChunkMemory) -> Result<Arc<Chunk>> {
        Chunk::with_access(memory, false)
    }

    /// A chunk peers may write (host chunks: they get a writable descriptor).
    pub fn writable(memory: ChunkMemory) -> Result<Arc<Chunk>> {
        Chunk::with_access(memory, true)
    }

    fn with_access(memory: ChunkMemory, writable: bool) -> Result<Arc<Chunk>> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut chunk = Chunk {
            id,
            memory,
            writable,
            device_uuid: None,
            exported: OnceLock::new(),
            announced_to: Mutex::new(Vec::new()),
            granted: Mutex::new(Vec::new()),
        };
        if let Some(memory) = chunk.device() {
            chunk.device_uuid = Some(memory.context().device().uuid()?);
        }
        Ok(Arc::new(chunk))
    }

    /// Remembers that `peer` maps this chunk (forgetting peers that are gone).
    pub fn announced(&self, peer: std::sync::Weak<dyn RetireListener>) {
        let mut peers = lock(&self.announced_to);
        peers.retain(|p| p.strong_count() > 0);
        // Announced again (the peer lost the first announcement's descriptor): still one peer,
        // told once.
        if !peers.iter().any(|p| p.ptr_eq(&peer)) {
            peers.push(peer);
        }
    }

    /// Whether this process made the chunk (only those can be sent; a received one is the
    /// sender's, and its leases are the sender's to give).
    pub fn is_local(&self) -> bool {
        matches!(self.memory, ChunkMemory::Host(_) | ChunkMemory::Vmm(_) | ChunkMemory::Legacy(_))
    }

    pub fn len(&self) -> usize {
        match &self.memory {
            ChunkMemory::Host(m) | ChunkMemory::ImportedHost(m) => m.len(),
            ChunkMemory::Vmm(m) | ChunkMemory::ImportedVmm(m) => m.len(),
            ChunkMemory::Legacy(m) => m.len(),
            ChunkMemory::ImportedLegacy(m) => m.len(),
        }
    }

    /// The device memory, for device chunks.
    pub fn device(&self) -> Option<&dyn DeviceMemory> {
        match &self.memory {
            ChunkMemory::Vmm(m) | ChunkMemory::ImportedVmm(m) => Some(m),
            ChunkMemory::Legacy(m) => Some(m.as_ref()),
            ChunkMemory::ImportedLegacy(m) => Some(m),
            ChunkMemory::Host(_) | ChunkMemory::ImportedHost(_) => None,
        }
    }

    /// Lets `peer`'s device read and write this device chunk over a peer link (once per device):
    /// VMM memory by its access list, a legacy buffer by peer access between the contexts.
    pub fn grant_access(&self, peer: &Arc<Context>) -> Result<()> {
        // A string: only this crate asks, and only for device chunks (no caller acts on it).
        let Some(memory) = self.device() else { return Err(Error::Invalid("host memory needs no peer access".into())) };
        let ordinal = peer.device().ordinal();
        if memory.context().device().ordinal() == ordinal {
            return Ok(());
        }
        let mut granted = lock(&self.granted);
        if granted.contains(&ordinal) {
            return Ok(());
        }
        match &self.memory {
            ChunkMemory::Vmm(m) | ChunkMemory::ImportedVmm(m) => m.grant_access(peer)?,
            _ => peer.enable_peer_access(memory.context())?,
        }
        granted.push(ordinal);
        Ok(())
    }

    /// The host mapping, for host chunks.
    pub fn host(&self) -> Option<&SharedMemory> {
        match &self.memory {
            ChunkMemory::Host(m) | ChunkMemory::ImportedHost(m) => Some(m),
            _ => None,
        }
    }

    /// The device's UUID, for device chunks.
    pub fn device_uuid(&self) -> Option<Uuid> {
        self.device_uuid
    }

    /// What a peer needs to map this chunk: the descriptor to attach (host and VMM chunks) or the
    /// legacy handle.
    pub fn share(&self) -> Result<Shared<'_>> {
        let exported = |export: &dyn Fn() -> Result<OwnedFd>| -> Result<Shared<'_>> {
            if self.exported.get().is_none() {
                let _ = self.exported.set(export()?);
            }
            let fd = self.exported.get().ok_or_else(|| Error::internal("an export vanished"))?;
            Ok(Shared::Fd(std::os::fd::AsFd::as_fd(fd)))
        };
        match &self.memory {
            ChunkMemory::Host(memory) if self.writable => Ok(Shared::Fd(memory.fd())),
            ChunkMemory::Host(memory) => exported(&|| Ok(memory.read_only_fd()?)),
            ChunkMemory::Vmm(memory) => exported(&|| Ok(memory.export()?)),
            ChunkMemory::Legacy(buffer) => Ok(Shared::Legacy(buffer.export()?)),
            _ => Err(not_sendable()),
        }
    }
}

/// Why a received tensor cannot be sent on as it is.
pub(crate) fn not_sendable() -> Error {
    Error::NotSendable(
        "a tensor received from another process cannot be sent on as it is: its memory is the \
         sender's, leased to this process; copy it into a tensor of this process first"
            .into(),
    )
}

/// How a chunk travels to a peer.
pub(crate) enum Shared<'a> {
    Fd(std::os::fd::BorrowedFd<'a>),
    Legacy(IpcMemHandle),
}

/// Free ranges of one chunk, by offset, coalesced.
#[derive(Default)]
struct FreeList(BTreeMap<usize, usize>);

impl FreeList {
    fn whole(len: usize) -> FreeList {
        FreeList(BTreeMap::from([(0, len)]))
    }

    fn take(&mut self, len: usize) -> Option<usize> {
        let (&offset, &free) = self.0.iter().find(|&(_, &free)| free >= len)?;
        self.0.remove(&offset);
        if free > len {
            self.0.insert(offset + len, free - len);
        }
        Some(offset)
    }

    fn give(&mut self, offset: usize, len: usize) {
        let (mut start, mut len) = (offset, len);
        if let Some((&before, &before_len)) = self.0.range(..start).next_back()
            && before + before_len == start
        {
            self.0.remove(&before);
            start = before;
            len += before_len;
        }
        if let Some(&after_len) = self.0.get(&(start + len)) {
            self.0.remove(&(start + len));
            len += after_len;
        }
        self.0.insert(start, len);
    }
}

/// What an arena allocates in.
#[derive(Clone)]
pub(crate) enum ArenaKind {
    /// Shared memory; `writable`: peers get a descriptor that lets them write.
    Host {
        writable: bool,
    },
    Device(Arc<Context>),
}

/// One chunk of an arena and what of it is free.
struct Slot {
    chunk: Arc<Chunk>,
    free: FreeList,
    /// Bytes handed out.
    used: usize,
    /// Since when no allocation has lived in it.
    idle_since: Option<Instant>,
}

/// Chunks of one kind (host, or one device) and their free space.
pub(crate) struct Arena {
    kind: ArenaKind,
    slots: Mutex<Vec<Slot>>,
}

/// An allocation from an arena, returned to it on drop.
pub(crate) struct Allocation {
    pub chunk: Arc<Chunk>,
    pub offset: usize,
    pub len: usize,
    arena: Arc<Arena>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let mut slots = lock(&self.arena.slots);
        if let Some(slot) = slots.iter_mut().find(|s| s.chunk.id == self.chunk.id) {
            slot.free.give(self.offset, self.len);
            slot.used -= self.len;
            if slot.used == 0 {
                slot.idle_since = Some(Instant::now());
                drop(slots);
                Trimmer::get().chunk_fell_idle();
            }
        }
    }
}

/// Every arena of the process, for [`crate::memory`].
static ARENAS: Mutex<Vec<Arc<Arena>>> = Mutex::new(Vec::new());

impl Arena {
    fn register(kind: ArenaKind) -> Arc<Arena> {
        let arena = Arc::new(Arena { kind, slots: Mutex::new(Vec::new()) });
        lock(&ARENAS).push(arena.clone());
        arena
    }

    /// The process's host arena: peers map its chunks read-only.
    pub fn host() -> Arc<Arena> {
        static HOST: OnceLock<Arc<Arena>> = OnceLock::new();
        HOST.get_or_init(|| Arena::register(ArenaKind::Host { writable: false })).clone()
    }

    /// The process's host arena whose chunks peers may write.
    pub fn host_writable() -> Arc<Arena> {
        static HOST: OnceLock<Arc<Arena>> = OnceLock::new();
        HOST.get_or_init(|| Arena::register(ArenaKind::Host { writable: true })).clone()
    }

    /// The process's arena for `context`'s device.
    pub fn device(context: &Arc<Context>) -> Arc<Arena> {
        /// Arenas by device ordinal.
        type Devices = Mutex<Vec<(i32, Arc<Arena>)>>;
        static DEVICES: OnceLock<Devices> = OnceLock::new();
        let mut devices = lock(DEVICES.get_or_init(Default::default));
        let ordinal = context.device().ordinal();
        if let Some((_, arena)) = devices.iter().find(|(o, _)| *o == ordinal) {
            return arena.clone();
        }
        let arena = Arena::register(ArenaKind::Device(context.clone()));
        devices.push((ordinal, arena.clone()));
        arena
    }

    /// `len` bytes (at least one), aligned to [`ALIGNMENT`].
    pub fn allocate(self: &Arc<Self>, len: usize) -> Result<Allocation> {
        let len = len.max(1).div_ceil(ALIGNMENT) * ALIGNMENT;
        let mut slots = lock(&self.slots);
        for slot in slots.iter_mut() {
            if let Some(offset) = slot.free.take(len) {
                slot.used += len;
                slot.idle_since = None;
                return Ok(Allocation { chunk: slot.chunk.clone(), offset, len, arena: self.clone() });
            }
        }
        let chunk = self.new_chunk(len.max(CHUNK_BYTES))?;
        let mut free = FreeList::whole(chunk.len());
        let offset = free.take(len).ok_or_else(|| Error::internal("a new chunk is too small"))?;
        slots.push(Slot { chunk: chunk.clone(), free, used: len, idle_since: None });
        Ok(Allocation { chunk, offset, len, arena: self.clone() })
    }

    fn new_chunk(&self, len: usize) -> Result<Arc<Chunk>> {
        let (memory, writable) = match &self.kind {
            // Chunks shared read-only are write-sealed: receivers cannot make them writable.
            ArenaKind::Host { writable: false } => {
                (ChunkMemory::Host(SharedMemory::create_write_sealed("tensor-queue", len)?), false)
            }
            ArenaKind::Host { writable: true } => (ChunkMemory::Host(SharedMemory::create("tensor-queue", len)?), true),
            ArenaKind::Device(context) => (ChunkMemory::Vmm(VmmAllocation::new(context, len)?), false),
        };
        let chunk = Chunk::with_access(memory, writable)?;
        // Exported now, once: an arena chunk exists to be shared, and the export (0.7 ms per
        // 64 MiB on an H200) would otherwise land on the first message of every new channel
        // that carries it.
        chunk.share()?;
        Ok(chunk)
    }

    /// Gives back chunks with no allocation that have been idle since before `idle_before`
    /// (`None`: all of them); the bytes given back. The chunks are dropped after the lock is let
    /// go: dropping one tells its peers, which takes their locks.
    fn trim(&self, idle_before: Option<Instant>) -> usize {
        let mut gone = Vec::new();
        lock(&self.slots).retain_mut(|slot| match slot.idle_since {
            Some(since) if idle_before.is_none_or(|before| since <= before) => {
                gone.push(slot.chunk.clone());
                false
            }
            _ => true,
        });
        gone.iter().map(|chunk| chunk.len()).sum()
    }

    /// Bytes in chunks, and bytes handed out.
    fn usage(&self) -> (usize, usize) {
        let slots = lock(&self.slots);
        (slots.iter().map(|s| s.chunk.len()).sum(), slots.iter().map(|s| s.used).sum())
    }

    /// The earliest moment an idle chunk of this arena is due to go.
    fn next_due(&self, idle: Duration) -> Option<Instant> {
        lock(&self.slots).iter().filter_map(|s| s.idle_since).min().map(|since| since + idle)
    }
}

/// What this process's arenas hold.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor, memory};
/// let before = memory::usage();
/// let t = Tensor::zeros(DType::U8, &[4096])?;
/// assert!(memory::usage().in_use_bytes >= before.in_use_bytes + 4096);
/// drop(t);
/// assert_eq!(memory::usage().in_use_bytes, before.in_use_bytes, "nothing leaked");
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryUsage {
    /// Bytes of shared host memory held in chunks.
    pub host_bytes: usize,
    /// Bytes of device memory held in chunks, all devices together.
    pub device_bytes: usize,
    /// Of those, bytes of live tensors (including those a receiver still holds).
    pub in_use_bytes: usize,
}

/// What this process's arenas hold (see [`crate::memory::usage`]).
pub(crate) fn usage() -> MemoryUsage {
    let mut usage = MemoryUsage::default();
    for arena in lock(&ARENAS).clone() {
        let (held, used) = arena.usage();
        match arena.kind {
            ArenaKind::Host { .. } => usage.host_bytes += held,
            ArenaKind::Device(_) => usage.device_bytes += held,
        }
        usage.in_use_bytes += used;
    }
    usage
}

/// Gives back every chunk with no allocation now; the bytes given back.
pub(crate) fn trim() -> usize {
    lock(&ARENAS).clone().iter().map(|arena| arena.trim(None)).sum()
}

/// How long a free chunk stays for reuse, in milliseconds.
static IDLE_RELEASE_MS: AtomicU64 = AtomicU64::new(1000);

pub(crate) fn set_idle_release(idle: Duration) {
    IDLE_RELEASE_MS.store(idle.as_millis().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    Trimmer::get().wake();
}

/// Keeps `held` (a tensor's allocation or lease) until the GPU work recorded in `events` is
/// done: memory that work on another stream still uses must not be reused (see
/// `Tensor::record_stream`).
pub(crate) fn drop_after(events: Vec<Arc<Event>>, held: Box<dyn Send>) {
    let trimmer = Trimmer::get();
    lock(&trimmer.deferred).push((events, held));
    trimmer.wake();
}

/// How often memory held for pending GPU work is looked at.
const DEFERRED_POLL: Duration = Duration::from_micros(200);

/// The arenas' thread: it gives back chunks idle for longer than the idle release time, and lets
/// go of memory held for GPU work once that work is done. It sleeps until the next chunk is due,
/// polls while memory is held, and is woken when a chunk falls idle while none was due.
struct Trimmer {
    woken: Mutex<bool>,
    wake: Condvar,
    deferred: Mutex<Vec<Deferred>>,
    /// Whether the thread may sleep with no chunk due, so that a chunk falling idle must wake
    /// it. Otherwise it need not: a chunk falling idle now is due after every chunk the thread
    /// knows of, and the thread looks again when the first of those is due. (A consumer that
    /// drops each message before the next arrives makes a chunk fall idle per message: waking
    /// the thread each time cost a system call and a thread's wake-up per message.)
    sleeps_for_good: AtomicBool,
}

/// Something held until the GPU work recorded in the events is done.
type Deferred = (Vec<Arc<Event>>, Box<dyn Send>);

impl Trimmer {
    fn get() -> &'static Trimmer {
        static TRIMMER: OnceLock<&'static Trimmer> = OnceLock::new();
        TRIMMER.get_or_init(|| {
            let trimmer: &'static Trimmer = Box::leak(Box::new(Trimmer {
                woken: Mutex::new(false),
                wake: Condvar::new(),
                deferred: Mutex::new(Vec::new()),
                sleeps_for_good: AtomicBool::new(true),
            }));
            if let Err(error) = std::thread::Builder::new().name("tq-trim".into()).spawn(move || trimmer.run()) {
                tracing::warn!(%error, "no trim thread: free memory goes back only on memory::trim()");
            }
            trimmer
        })
    }

    fn wake(&self) {
        *lock(&self.woken) = true;
        self.wake.notify_one();
    }

    /// A chunk fell idle (its arena's lock was let go after it was marked).
    fn chunk_fell_idle(&self) {
        if self.sleeps_for_good.load(Ordering::SeqCst) {
            self.wake();
        }
    }

    fn run(&self) {
        loop {
            // Set before the arenas are looked at: a chunk that falls idle after its arena was
            // looked at sees it and wakes the thread (see `sleeps_for_good`).
            self.sleeps_for_good.store(true, Ordering::SeqCst);
            // Dropped outside the lock: dropping may free chunks and send frames.
            let done: Vec<_> = {
                let mut deferred = lock(&self.deferred);
                let (done, waiting) = std::mem::take(&mut *deferred)
                    .into_iter()
                    .partition(|(events, _)| events.iter().all(|e| e.is_complete().unwrap_or(true)));
                *deferred = waiting;
                done
            };
            drop(done);
            let polling = !lock(&self.deferred).is_empty();
            let idle = Duration::from_millis(IDLE_RELEASE_MS.load(Ordering::Relaxed));
            let arenas = lock(&ARENAS).clone();
            let now = Instant::now();
            for arena in &arenas {
                arena.trim(now.checked_sub(idle));
            }
            let mut due = arenas.iter().filter_map(|arena| arena.next_due(idle)).min();
            if due.is_some() {
                self.sleeps_for_good.store(false, Ordering::SeqCst);
            }
            if polling {
                due = Some(due.map_or(now + DEFERRED_POLL, |due| due.min(now + DEFERRED_POLL)));
            }
            let mut woken = lock(&self.woken);
            while !*woken {
                let left = due.map(|due| due.saturating_duration_since(Instant::now()));
                match left {
                    Some(left) if left.is_zero() => break,
                    Some(left) => woken = self.wake.wait_timeout(woken, left).unwrap_or_else(|e| e.into_inner()).0,
                    None => woken = self.wake.wait(woken).unwrap_or_else(|e| e.into_inner()),
                }
            }
            *woken = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_space_coalesces() {
        let mut free = FreeList::whole(1000);
        let a = free.take(100).unwrap();
        let b = free.take(200).unwrap();
        let c = free.take(300).unwrap();
        assert_eq!((a, b, c), (0, 100, 300));
        free.give(b, 200);
        assert_eq!(free.take(250), Some(600), "the 200-byte hole is too small");
        free.give(a, 100);
        free.give(c, 300);
        assert_eq!(free.0, BTreeMap::from([(0, 600), (850, 150)]));
        assert_eq!(free.take(600), Some(0));
    }

    #[test]
    fn host_allocations_reuse_one_chunk_and_idle_chunks_go_back() {
        let arena = Arc::new(Arena { kind: ArenaKind::Host { writable: false }, slots: Mutex::new(Vec::new()) });
        let first = arena.allocate(1000).unwrap();
        let second = arena.allocate(1).unwrap();
        assert_eq!(first.chunk.id, second.chunk.id);
        assert_eq!(second.offset, 1024, "aligned after the first");
        drop(first);
        assert_eq!(arena.trim(None), 0, "a chunk in use stays");
        drop(second);
        assert_eq!(arena.usage(), (CHUNK_BYTES, 0), "all space returned, the chunk kept for reuse");
        let big = arena.allocate(CHUNK_BYTES + 1).unwrap();
        assert!(big.chunk.len() > CHUNK_BYTES, "a large tensor gets a chunk of its own");
        assert_eq!(arena.trim(Some(Instant::now() - Duration::from_secs(60))), 0, "not idle for long enough");
        assert_eq!(arena.trim(None), CHUNK_BYTES, "the idle chunk goes back, the one in use stays");
        drop(big);
        assert!(arena.trim(None) > CHUNK_BYTES);
        assert_eq!(arena.usage(), (0, 0));
    }
}
