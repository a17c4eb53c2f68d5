//! A message on its way out: encoded once, checked, and fenced after the producer's work; the
//! same for one receiver or for every receiver of a broadcast.

use std::sync::{Arc, OnceLock};

use ipc_core::Stream;
use serde::Serialize;

use crate::clock::monotonic_ns;
use crate::error::{Error, Result};
use crate::memory::arena::not_sendable;
use crate::memory::signal::{Signal, signal_after, signals_supported};
use crate::side_table;
use crate::tensor::Tensor;
use crate::tensor::layout::check_layout;

/// A message encoded once, with what orders its receivers after the producer's work.
pub(crate) struct Outgoing<'a> {
    pub sent_ns: u64,
    pub payload: Vec<u8>,
    /// The message's tensors, shared with what must keep them until it is done with them (an
    /// NCCL transfer holds the whole table, not a count on each tensor's storage).
    pub tensors: Arc<Vec<Tensor>>,
    /// Per tensor, the bytes of its storage its view touches (`Tensor::touched_bytes`), found
    /// once, by the check every tensor passes before anything is sent.
    pub touched: Vec<(usize, usize)>,
    pub fencing: Fencing<'a>,
    /// The producer's stream, for `send_on`: copies a route needs are queued on it.
    pub stream: Option<&'a Stream>,
}

/// The message's table of tensors goes back to this thread's encoder once sent, emptied (unless
/// a transfer still holds it): the next message's table is made in it, not allocated (and
/// freed) again.
impl Drop for Outgoing<'_> {
    fn drop(&mut self) {
        if let Some(table) = Arc::get_mut(&mut self.tensors) {
            side_table::recycle(std::mem::take(table));
        }
    }
}

/// How the receivers' first use of the GPU tensors is ordered after the producer's work.
pub(crate) enum Fencing<'a> {
    /// Nothing to wait for: no GPU tensors, or their devices were synchronised.
    Done,
    /// A signal word's write on the producer's stream, which every receiver of tensors mapped
    /// where they are waits for: queued once, when the first such receiver needs it.
    Signal(LazySignal<'a>),
    /// An interprocess event of each connection, recorded on the stream when sent (the fallback).
    Event(&'a Stream),
}

/// A message's signal word, written on the producer's stream the first time a receiver maps a
/// tensor where it is (the same GPU, or over the peer link), then shared by every receiver. A
/// message whose tensors are all copied (each copy is fenced by a word of its own) writes none,
/// so no stream operation runs ahead of its copies.
pub(crate) struct LazySignal<'a> {
    stream: &'a Stream,
    signal: OnceLock<Signal>,
}

impl LazySignal<'_> {
    /// The word and value, queued now if they were not yet.
    pub fn get(&self) -> Result<&Signal> {
        if let Some(signal) = self.signal.get() {
            return Ok(signal);
        }
        let signal = signal_after(self.stream)?
            .ok_or_else(|| Error::internal("no signal word on a device that has stream memory operations"))?;
        // Two receivers racing both queue a write: either value follows the producer's work.
        Ok(self.signal.get_or_init(|| signal))
    }
}

impl<'a> Outgoing<'a> {
    /// Encodes `message` and checks every tensor before anything is leased, fenced or sent, so a
    /// refused message leaves nothing behind. Its fencing is yet to be chosen (`Done` until then).
    fn encode<T: Serialize>(message: &T) -> Result<Outgoing<'a>> {
        let sent_ns = monotonic_ns();
        let (payload, tensors) = side_table::encode(message)?;
        let mut touched = Vec::with_capacity(tensors.len());
        for tensor in &tensors {
            touched.push(check_sendable(tensor)?);
        }
        let tensors = Arc::new(tensors);
        Ok(Outgoing { sent_ns, payload, tensors, touched, fencing: Fencing::Done, stream: None })
    }

    /// `message` with its GPU tensors' devices synchronised (a CPU stall).
    pub fn synchronized<T: Serialize>(message: &T) -> Result<Outgoing<'a>> {
        let outgoing = Outgoing::encode(message)?;
        let mut done = Vec::new();
        for memory in outgoing.tensors.iter().filter_map(|t| t.storage.chunk.device()) {
            let context = memory.context();
            if !done.contains(&context.device().ordinal()) {
                context.synchronize()?;
                done.push(context.device().ordinal());
            }
        }
        Ok(outgoing)
    }

    /// `message` whose GPU tensors were produced by work queued on `stream`: a signal word where
    /// the device supports it and every GPU tensor is on the stream's device, else events.
    pub fn on_stream<T: Serialize>(message: &T, stream: &'a Stream) -> Result<Outgoing<'a>> {
        let mut outgoing = Outgoing::encode(message)?;
        let ordinal = stream.context().device().ordinal();
        let (mut gpu, mut all_on_stream_device) = (false, true);
        for memory in outgoing.tensors.iter().filter_map(|t| t.storage.chunk.device()) {
            gpu = true;
            all_on_stream_device &= memory.context().device().ordinal() == ordinal;
        }
        let fencing = if !gpu {
            Fencing::Done
        } else if all_on_stream_device && signals_supported(stream.context())? {
            Fencing::Signal(LazySignal { stream, signal: OnceLock::new() })
        } else {
            Fencing::Event(stream)
        };
        outgoing.fencing = fencing;
        outgoing.stream = Some(stream);
        Ok(outgoing)
    }
}

/// Whether `tensor` can be sent (memory of this process, and a view every receiver accepts):
/// the bytes of its storage it touches.
fn check_sendable(tensor: &Tensor) -> Result<(usize, usize)> {
    if !tensor.storage.chunk.is_local() {
        return Err(not_sendable());
    }
    let touched = tensor.touched_bytes()?;
    let offset = (tensor.storage.offset + tensor.offset()) as u64;
    check_layout(tensor.shape(), tensor.strides(), tensor.dtype(), offset).map_err(Error::Invalid)?;
    Ok(touched)
}
