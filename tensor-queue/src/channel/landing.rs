//! The receiver's half of the routes (see [`crate::route`]): what a connection does with a
//! tensor that crossed from another GPU: mapped over a peer link (ordered through the sender's
//! GPU), copied in from staging memory piece by piece, or waited for on the CPU.

use std::sync::Arc;

use ipc_core::{Event, Stream};

use super::connection::{Connected, Devices};
use super::fences::FenceWait;
use crate::arena::{Allocation, Arena, Chunk};
use crate::route::{self, Route};
use crate::wire::{Fence, TensorDesc};
use crate::{Error, Result};

impl Connected {
    /// Refuses a route this receiver's policy forbids (an honest sender never sends one: it
    /// asks `crate::route::choose` first).
    pub(super) fn check_route(&self, devices: &Devices, index: usize, desc: &TensorDesc) -> Result<()> {
        let strict = devices.routing.strict;
        // Whether the landing was a fallback is the sender's knowledge: the lenient reading here.
        if !route::allowed(desc.route, strict, false) {
            let reason = format!("route {} is refused by this receiver's policy ({strict:?})", desc.route);
            return Err(self.refusal(index, reason));
        }
        Ok(())
    }

    /// Queues the wait for the producer's fence of tensor `index` on `stream`; for a tensor
    /// mapped over a peer link, on this connection's stream for the sender's GPU first (where the
    /// fence lives), which `stream` then waits for.
    pub(super) fn order_for(
        &mut self,
        devices: &Devices,
        index: usize,
        desc: &TensorDesc,
        chunk: &Arc<Chunk>,
        stream: &Arc<Stream>,
    ) -> Result<Option<FenceWait>> {
        if desc.route != Route::PeerMap {
            return self.order(index, desc, chunk, stream);
        }
        let uuid = chunk.device_uuid().ok_or_else(|| Error::Protocol("a device chunk without a device".into()))?;
        let home = self.stream(devices, &uuid)?;
        let fence = self.order(index, desc, chunk, &home)?;
        let done = Event::new(home.context())?;
        done.record(&home)?;
        stream.wait_event(&done)?;
        Ok(fence)
    }

    /// Allocates staged tensor `index`'s storage on `stream`'s GPU and queues, per piece, the
    /// wait for the producer's host word and the copy out of the staging memory.
    pub(super) fn copy_in(
        &mut self,
        index: usize,
        desc: &TensorDesc,
        staging: &Arc<Chunk>,
        stream: &Arc<Stream>,
        fences: &mut Vec<FenceWait>,
    ) -> Result<Allocation> {
        let bad = |reason: String| self.refusal(index, reason);
        let (signal, offset, value) = self.host_signal(index, desc)?;
        let (_, producer) = self.producer.as_ref().ok_or_else(|| Error::Protocol("no Hello".into()))?;
        let producer = producer.clone();
        let len = desc.storage_len as usize;
        let allocation = Arena::device(stream.context()).allocate(len)?;
        let destination =
            allocation.chunk.device().ok_or_else(|| Error::Protocol("a device arena in host memory".into()))?;
        let host = staging.host().ok_or_else(|| bad("staged from device memory".into()))?;
        let source = host.registered(stream.context())?;
        let piece = route::staging_piece(len);
        for k in 0..len.div_ceil(piece) {
            if !super::switches::skip_ordering() {
                let value = value.checked_add(k as u64).ok_or_else(|| bad(format!("signal value {value}")))?;
                fences.push(producer.wait(stream, &signal, offset, value).map_err(|e| match e {
                    Error::Core(ipc_core::Error::OutOfBounds { .. } | ipc_core::Error::InvalidArgument(_)) => {
                        bad(format!("signal word {offset}: {e}"))
                    }
                    other => other,
                })?);
            }
            let at = k * piece;
            let n = piece.min(len - at);
            stream.copy_async(destination, allocation.offset + at, &source, desc.storage_offset as usize + at, n)?;
        }
        Ok(allocation)
    }

    /// Notes the host word a host-route tensor's data waits for; `recv` waits for it on the CPU.
    /// The sender copied the storage in pieces, each followed by the next value of the word (see
    /// `signal::host_signal_pieces`): the data is whole only once the last piece's value is there.
    pub(super) fn fence_on_cpu(&self, index: usize, desc: &TensorDesc) -> Result<Option<FenceWait>> {
        let (signal, offset, first) = self.host_signal(index, desc)?;
        let (_, producer) = self.producer.as_ref().ok_or_else(|| Error::Protocol("no Hello".into()))?;
        let len = desc.storage_len as usize;
        let pieces = len.div_ceil(route::staging_piece(len)).max(1);
        let value =
            first.checked_add(pieces as u64 - 1).ok_or_else(|| self.refusal(index, format!("signal value {first}")))?;
        producer.wait_on_cpu(&signal, offset, value).map(Some).map_err(|e| match e {
            Error::Core(_) => self.refusal(index, format!("signal word {offset}: {e}")),
            other => other,
        })
    }

    /// The host word, offset and first value a copied tensor's fence names.
    pub(super) fn host_signal(&self, index: usize, desc: &TensorDesc) -> Result<(Arc<Chunk>, usize, u64)> {
        let bad = |reason: String| self.refusal(index, reason);
        let Fence::Signal { chunk, offset, value } = desc.fence else {
            return Err(bad(format!("a {} tensor without a host signal", desc.route)));
        };
        let signal = self.chunks.get(&chunk).cloned().ok_or_else(|| bad(format!("unknown chunk {chunk}")))?;
        if signal.host().is_none() {
            return Err(bad(format!("signal chunk {chunk} is not host memory")));
        }
        let offset = usize::try_from(offset).map_err(|_| bad(format!("signal offset {offset}")))?;
        Ok((signal, offset, value))
    }
}
