//! Where sendable tensors live: chunks of shareable memory, each exported at most once.
//!
//! Exporting costs 0.7 ms (VMM) and opening 53-129 us, so tensors are not allocated one by one:
//! they are carved out of large chunks (64 MiB, or one chunk for a larger tensor). A chunk is
//! announced to each peer once, with its descriptor; afterwards a message names only
//! (chunk, offset, length). Freed space is reused, never returned, so a peer's mapping of a chunk
//! stays valid for the chunk's whole life.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use ipc_core::{
    Context, DeviceBuffer, DeviceMemory, ImportedIpcMemory, IpcMemHandle, SharedMemory, Uuid, VmmAllocation,
};

use crate::{Error, Result};

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

/// A range of shareable memory with a process-unique id.
pub(crate) struct Chunk {
    pub id: u64,
    pub memory: ChunkMemory,
    /// The device's UUID for device chunks, asked of the driver once (it is on every hand-off's path).
    device_uuid: Option<Uuid>,
    /// The VMM export, made on the first announcement and reused for every later peer.
    exported: OnceLock<OwnedFd>,
    /// Peers this chunk was announced to, told to forget it when it is freed.
    announced_to: Mutex<Vec<std::sync::Weak<dyn RetireListener>>>,
}

/// A connection that must hear when a chunk it announced is freed.
pub(crate) trait RetireListener: Send + Sync {
    fn retire(&self, chunk: u64);
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let peers = std::mem::take(&mut *self.announced_to.lock().unwrap_or_else(|e| e.into_inner()));
        for peer in peers.iter().filter_map(std::sync::Weak::upgrade) {
            peer.retire(self.id);
        }
    }
}

impl Chunk {
    pub fn new(memory: ChunkMemory) -> Result<Arc<Chunk>> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Chunk::with_id(NEXT_ID.fetch_add(1, Ordering::Relaxed), memory)
    }

    pub fn with_id(id: u64, memory: ChunkMemory) -> Result<Arc<Chunk>> {
        let mut chunk =
            Chunk { id, memory, device_uuid: None, exported: OnceLock::new(), announced_to: Mutex::new(Vec::new()) };
        if let Some(memory) = chunk.device() {
            chunk.device_uuid = Some(memory.context().device().uuid()?);
        }
        Ok(Arc::new(chunk))
    }

    /// Remembers that `peer` maps this chunk.
    pub fn announced(&self, peer: std::sync::Weak<dyn RetireListener>) {
        self.announced_to.lock().unwrap_or_else(|e| e.into_inner()).push(peer);
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
        match &self.memory {
            ChunkMemory::Host(memory) => Ok(Shared::Fd(memory.fd())),
            ChunkMemory::Vmm(memory) => {
                if self.exported.get().is_none() {
                    let _ = self.exported.set(memory.export()?);
                }
                let fd = self.exported.get().ok_or_else(|| Error::Protocol("VMM export vanished".into()))?;
                Ok(Shared::Fd(std::os::fd::AsFd::as_fd(fd)))
            }
            ChunkMemory::Legacy(buffer) => Ok(Shared::Legacy(buffer.export()?)),
            _ => Err(Error::Protocol("a received chunk cannot be forwarded; copy the tensor first".into())),
        }
    }
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
    Host,
    Device(Arc<Context>),
}

/// Chunks of one kind (host, or one device) and their free space.
pub(crate) struct Arena {
    kind: ArenaKind,
    chunks: Mutex<Vec<(Arc<Chunk>, FreeList)>>,
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
        let mut chunks = self.arena.chunks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, free)) = chunks.iter_mut().find(|(c, _)| c.id == self.chunk.id) {
            free.give(self.offset, self.len);
        }
    }
}

impl Arena {
    /// The process's host arena.
    pub fn host() -> Arc<Arena> {
        static HOST: OnceLock<Arc<Arena>> = OnceLock::new();
        HOST.get_or_init(|| Arc::new(Arena { kind: ArenaKind::Host, chunks: Mutex::new(Vec::new()) })).clone()
    }

    /// The process's arena for `context`'s device.
    pub fn device(context: &Arc<Context>) -> Arc<Arena> {
        /// Arenas by device ordinal.
        type Devices = Mutex<Vec<(i32, Arc<Arena>)>>;
        static DEVICES: OnceLock<Devices> = OnceLock::new();
        let mut devices = DEVICES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        let ordinal = context.device().ordinal();
        if let Some((_, arena)) = devices.iter().find(|(o, _)| *o == ordinal) {
            return arena.clone();
        }
        let arena = Arc::new(Arena { kind: ArenaKind::Device(context.clone()), chunks: Mutex::new(Vec::new()) });
        devices.push((ordinal, arena.clone()));
        arena
    }

    /// `len` bytes (at least one), aligned to [`ALIGNMENT`].
    pub fn allocate(self: &Arc<Self>, len: usize) -> Result<Allocation> {
        let len = len.max(1).div_ceil(ALIGNMENT) * ALIGNMENT;
        let mut chunks = self.chunks.lock().unwrap_or_else(|e| e.into_inner());
        for (chunk, free) in chunks.iter_mut() {
            if let Some(offset) = free.take(len) {
                return Ok(Allocation { chunk: chunk.clone(), offset, len, arena: self.clone() });
            }
        }
        let chunk = self.new_chunk(len.max(CHUNK_BYTES))?;
        let mut free = FreeList::whole(chunk.len());
        let offset = free.take(len).ok_or_else(|| Error::Protocol("a new chunk is too small".into()))?;
        chunks.push((chunk.clone(), free));
        Ok(Allocation { chunk, offset, len, arena: self.clone() })
    }

    fn new_chunk(&self, len: usize) -> Result<Arc<Chunk>> {
        let memory = match &self.kind {
            ArenaKind::Host => ChunkMemory::Host(SharedMemory::create("tensor-queue", len)?),
            ArenaKind::Device(context) => ChunkMemory::Vmm(VmmAllocation::new(context, len)?),
        };
        let chunk = Chunk::new(memory)?;
        if matches!(chunk.memory, ChunkMemory::Vmm(_)) {
            // Exported now, once: an arena chunk exists to be shared, and the export (0.7 ms per
            // 64 MiB on an H200) would otherwise land on the first message of every new channel
            // that carries it.
            chunk.share()?;
        }
        Ok(chunk)
    }

    /// Bytes in chunks, and bytes free in them.
    #[cfg(test)]
    fn usage(&self) -> (usize, usize) {
        let chunks = self.chunks.lock().unwrap();
        let total = chunks.iter().map(|(c, _)| c.len()).sum();
        let free = chunks.iter().flat_map(|(_, f)| f.0.values()).sum();
        (total, free)
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
    fn host_allocations_reuse_one_chunk() {
        let arena = Arc::new(Arena { kind: ArenaKind::Host, chunks: Mutex::new(Vec::new()) });
        let first = arena.allocate(1000).unwrap();
        let second = arena.allocate(1).unwrap();
        assert_eq!(first.chunk.id, second.chunk.id);
        assert_eq!(second.offset, 1024, "aligned after the first");
        drop(first);
        drop(second);
        assert_eq!(arena.usage(), (CHUNK_BYTES, CHUNK_BYTES), "all space returned");
        let big = arena.allocate(CHUNK_BYTES + 1).unwrap();
        assert!(big.chunk.len() > CHUNK_BYTES, "a large tensor gets a chunk of its own");
    }
}
