//! Mapping the chunks peers announce: once per process, whatever the number of connections.
//!
//! Several senders of one process (one `Sender` per thread, say) each announce the same chunks.
//! Importing one VMM allocation several times into one process is what broke a receiver's
//! context (`CUDA_ERROR_ILLEGAL_ADDRESS` with eight senders in one process), and it costs an
//! import and a mapping each time. So imports are shared: keyed by the peer process (its pid, as
//! the kernel reports it, and the random instance of its `Hello`, since a pid is reused after a
//! process dies) and the peer's chunk id. A peer can only ever name its own chunks this way.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use ipc_core::{Context, ImportedIpcMemory, IpcMemHandle, SharedMemory, Uuid, VmmAllocation};

use crate::error::{Error, Result, Violation};
use crate::memory::arena::{Chunk, ChunkMemory};
use crate::sync::lock;
use crate::wire::ChunkKind;

/// A chunk as a peer announced it.
pub(crate) struct Announced {
    pub id: u64,
    pub len: usize,
    pub kind: ChunkKind,
    pub device: Uuid,
    pub legacy: Option<Vec<u8>>,
    pub fd: Option<OwnedFd>,
}

/// (peer pid, peer instance, peer's chunk id).
type Key = (u32, u64, u64);

static IMPORTS: Mutex<Option<HashMap<Key, Weak<Chunk>>>> = Mutex::new(None);

/// The chunk `announced` by the process (`pid`, `instance`), mapped in this process once.
/// `context` gives the context of a device by UUID.
pub(crate) fn import(
    pid: u32,
    instance: u64,
    announced: Announced,
    context: impl Fn(&Uuid) -> Result<Arc<Context>>,
) -> Result<Arc<Chunk>> {
    let key = (pid, instance, announced.id);
    let mut imports = lock(&IMPORTS);
    let imports = imports.get_or_insert_with(HashMap::new);
    if let Some(chunk) = imports.get(&key).and_then(Weak::upgrade) {
        let same_device = chunk.device_uuid().is_none_or(|uuid| uuid == announced.device);
        if chunk.len() != announced.len || !same_device {
            return Err(Violation::ChunkChanged { id: announced.id }.into());
        }
        return Ok(chunk);
    }
    let chunk = map(announced, context)?;
    if imports.len() >= 64 {
        imports.retain(|_, chunk| chunk.strong_count() > 0);
    }
    imports.insert(key, Arc::downgrade(&chunk));
    Ok(chunk)
}

fn map(announced: Announced, context: impl Fn(&Uuid) -> Result<Arc<Context>>) -> Result<Arc<Chunk>> {
    let Announced { id, len, kind, device, legacy, fd } = announced;
    let missing_fd = || Error::from(Violation::MissingDescriptor { id });
    let memory = match kind {
        ChunkKind::Host => ChunkMemory::ImportedHost(SharedMemory::from_fd(fd.ok_or_else(missing_fd)?, len)?),
        ChunkKind::Vmm => {
            let fd = fd.ok_or_else(missing_fd)?;
            ChunkMemory::ImportedVmm(VmmAllocation::import(&context(&device)?, fd.as_fd().as_raw_fd(), len)?)
        }
        ChunkKind::Legacy => {
            let handle = IpcMemHandle::from_bytes(legacy.as_deref().unwrap_or_default())?;
            if handle.len() != len || handle.device() != device {
                return Err(Violation::HandleMismatch { id }.into());
            }
            context(&device)?; // the device's primary context, kept alive while mapped
            ChunkMemory::ImportedLegacy(ImportedIpcMemory::open(&handle)?)
        }
    };
    Chunk::new(memory)
}
