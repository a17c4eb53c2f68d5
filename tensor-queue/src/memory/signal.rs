//! Stream-ordered signals: how a receiver's stream waits for a producer's work.
//!
//! Each producer stream owns one 64-bit word in a block of signal words of its device (a VMM
//! allocation, shared with receivers like any chunk). After the producer's work, `send_on` queues
//! a write of the next value of that word on the stream (`cuStreamWriteValue64`, with a memory
//! fence before it), when a receiver maps one of the message's tensors where it is; the receiver
//! queues a wait for that value on its own stream (`cuStreamWaitValue64`), over the peer link when
//! its stream is on another GPU. Neither CPU waits. A peer copy is fenced on the GPU it lands on:
//! the producer's stream writes a word of that GPU right after the copy ([`signal_on_peer_after`]).
//!
//! Why not interprocess events: on an H200 the receiver's stream took 140-580 us to get past a
//! wait on an imported interprocess event that was already complete (`tq-bench`: the first
//! message's "until usable" stage, the warm broadcast), as `GPU.md` also measured (141 us). A
//! stream wait on a memory word measured 7 us there. Events remain the fallback for devices
//! without 64-bit stream memory operations.
//!
//! Values only grow, and the writes of one stream execute in order, so a wait for value `v` is
//! released exactly when the work queued before the write of `v` is done. The words live as long
//! as the process (a wait may still be queued in a receiver after its sender is gone), and a word
//! is shared by every sender that sends on its stream. A stream handle reused by the driver after
//! the stream was destroyed keeps the word and its count, which stays correct unless the old
//! stream's last write is still pending when the new one writes.

use std::sync::{Arc, Mutex, OnceLock};

use ipc_core::{Context, DeviceAttribute, DeviceMemory, Stream, VmmAllocation};

use crate::error::{Error, Result};
use crate::memory::arena::{Chunk, ChunkMemory};
use crate::sync::lock;

/// Words per block. A block is a VMM allocation of its own (not part of the device arena, whose
/// chunks go back to the driver when free: a word lives as long as the process).
const WORDS_PER_BLOCK: usize = 512;

/// Where a receiver waits, and for what value.
pub(crate) struct Signal {
    pub chunk: Arc<Chunk>,
    pub offset: usize,
    pub value: u64,
}

/// One word per producer stream, in blocks of [`WORDS_PER_BLOCK`].
struct Words {
    blocks: Vec<Arc<Chunk>>,
    /// Per producer stream: its handle and last value. Word `i` is word `i % WORDS_PER_BLOCK`
    /// of block `i / WORDS_PER_BLOCK`.
    words: Vec<(usize, u64)>,
}

impl Words {
    const fn new() -> Words {
        Words { blocks: Vec::new(), words: Vec::new() }
    }

    /// The block, byte offset and index of the word of the stream whose handle is `key`;
    /// `new_block` makes a block when the last one is full.
    fn word(
        &mut self,
        key: usize,
        new_block: impl FnOnce() -> Result<Arc<Chunk>>,
    ) -> Result<(Arc<Chunk>, usize, usize)> {
        let index = match self.words.iter().position(|w| w.0 == key) {
            Some(index) => index,
            None => {
                // A block made ahead ([`prepare`]) may already hold the new word.
                if self.words.len() / WORDS_PER_BLOCK >= self.blocks.len() {
                    self.blocks.push(new_block()?);
                }
                self.words.push((key, 0));
                self.words.len() - 1
            }
        };
        Ok((self.blocks[index / WORDS_PER_BLOCK].clone(), index % WORDS_PER_BLOCK * 8, index))
    }
}

/// The signal words of one device.
struct DeviceSignals {
    ordinal: i32,
    /// Whether the device has 64-bit stream memory operations.
    supported: bool,
    /// The stream that zeroes new blocks: its own, so that zeroing never waits for (or stalls the
    /// CPU behind) the work a producer has queued before its first send.
    zeroing: Option<Stream>,
    words: Words,
}

static SIGNALS: Mutex<Vec<DeviceSignals>> = Mutex::new(Vec::new());

/// The signal words of `context`'s device, found or added (asking the device once whether it
/// has 64-bit stream memory operations).
fn device_signals<'a>(all: &'a mut Vec<DeviceSignals>, context: &Context) -> Result<&'a mut DeviceSignals> {
    let ordinal = context.device().ordinal();
    let at = match all.iter().position(|d| d.ordinal == ordinal) {
        Some(at) => at,
        None => {
            let attribute = DeviceAttribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS;
            let supported = context.device().attribute(attribute)? != 0;
            all.push(DeviceSignals { ordinal, supported, zeroing: None, words: Words::new() });
            all.len() - 1
        }
    };
    Ok(&mut all[at])
}

/// A new block of zeroed signal words on `context`'s device, exported.
fn new_block(context: &Arc<Context>, zeroing: &mut Option<Stream>) -> Result<Arc<Chunk>> {
    let block = Chunk::new(ChunkMemory::Vmm(VmmAllocation::new(context, WORDS_PER_BLOCK * 8)?))?;
    block.share()?; // exported once, now, like an arena chunk
    // Zeroed, and the zeroing finished, before any stream can write to it (a copy from the
    // host could land after a stream's first write and erase it). On the device's zeroing
    // stream, not the producer's: its queued work must not delay the send.
    let zeroing = match zeroing {
        Some(zeroing) => zeroing,
        zeroing @ None => zeroing.insert(Stream::new(context)?),
    };
    device_memory(&block)?.memset_range_async(0, WORDS_PER_BLOCK * 8, 0, zeroing)?;
    zeroing.synchronize()?;
    Ok(block)
}

/// Makes the first block of signal words of `context`'s device ahead of the first send: its
/// export costs as much as an arena chunk's (0.7 ms on an H200), and is paid here, with the
/// process's first device tensor made for sending, instead of by the first message of its first
/// channel. A failure is left for that send to meet and report.
///
/// Called for every device tensor made to be sent (the Python package makes one per array it
/// sends), so only a device's first call takes [`SIGNALS`]'s lock: the others return at once.
pub(crate) fn prepare(context: &Arc<Context>) {
    static PREPARED: FirstTime = FirstTime::new();
    PREPARED.once(context.device().ordinal(), || {
        if let Err(error) = make_first_block(context) {
            tracing::debug!(%error, "no signal words made ahead; the first send makes them");
        }
    });
}

/// The work of [`prepare`]: the first block of `context`'s device, unless it has one or the
/// device lacks 64-bit stream memory operations.
fn make_first_block(context: &Arc<Context>) -> Result<()> {
    let mut all = lock(&SIGNALS);
    let device = device_signals(&mut all, context)?;
    if device.supported && !crate::switches::force_events() && device.words.blocks.is_empty() {
        let block = new_block(context, &mut device.zeroing)?;
        device.words.blocks.push(block);
    }
    Ok(())
}

/// Device ordinals that have a flag in [`FirstTime`]; a device beyond them does its work every
/// time, as if it were the first (correct, only slower).
const FLAGGED_DEVICES: usize = 64;

/// A flag per device ordinal, read without a lock: whether its first-time work was done.
struct FirstTime([OnceLock<()>; FLAGGED_DEVICES]);

impl FirstTime {
    const fn new() -> FirstTime {
        FirstTime([const { OnceLock::new() }; FLAGGED_DEVICES])
    }

    /// Runs `work` on the first call for `ordinal` only; a call meanwhile on another thread
    /// waits for it, and later calls return at once. Done once tried: what `work` could not do
    /// is left to whoever needs it.
    fn once(&self, ordinal: i32, work: impl FnOnce()) {
        match usize::try_from(ordinal).ok().and_then(|at| self.0.get(at)) {
            Some(flag) => {
                flag.get_or_init(work);
            }
            None => work(),
        }
    }
}

/// Whether [`signal_after`] gives a word on `context`'s device (it has 64-bit stream memory
/// operations, and events are not forced), without queueing anything.
pub(crate) fn signals_supported(context: &Context) -> Result<bool> {
    let mut all = lock(&SIGNALS);
    Ok(device_signals(&mut all, context)?.supported && !crate::switches::force_events())
}

/// Queues, on `stream`, the write of its word's next value and returns where and what to wait
/// for; `None` when the device lacks 64-bit stream memory operations (use an event instead).
pub(crate) fn signal_after(stream: &Stream) -> Result<Option<Signal>> {
    let context = stream.context();
    // One lock across the increment and the enqueue, so values reach each stream in order.
    let mut all = lock(&SIGNALS);
    let device = device_signals(&mut all, context)?;
    if !device.supported || crate::switches::force_events() {
        return Ok(None);
    }
    let zeroing = &mut device.zeroing;
    let (block, offset, index) = device.words.word(stream.raw() as usize, || new_block(context, zeroing))?;
    let value = device.words.words[index].1 + 1;
    stream.write_value64(device_memory(&block)?, offset, value)?;
    device.words.words[index].1 = value;
    Ok(Some(Signal { chunk: block, offset, value }))
}

/// Queues, on `stream`, the write of the next value of its word on `target`'s device (another
/// GPU, which the stream's device reaches over the peer link) and returns where and what a
/// stream of `target`'s device waits for there; `None` when either device lacks 64-bit stream
/// memory operations.
///
/// This is how a peer copy is fenced on the GPU it lands on: the producer's stream writes the
/// word right after the copy, in stream order, and the write is fenced after the copy's writes
/// (the driver's default memory barrier), so no stream or event of the target device is
/// involved. The word is one per producer stream per target device, as on the stream's own.
pub(crate) fn signal_on_peer_after(stream: &Stream, target: &Arc<Context>) -> Result<Option<Signal>> {
    let mut all = lock(&SIGNALS);
    if !device_signals(&mut all, stream.context())?.supported || crate::switches::force_events() {
        return Ok(None);
    }
    let device = device_signals(&mut all, target)?;
    if !device.supported {
        return Ok(None);
    }
    let zeroing = &mut device.zeroing;
    let (block, offset, index) = device.words.word(stream.raw() as usize, || new_block(target, zeroing))?;
    // Once per block and device (the chunk remembers).
    block.grant_access(stream.context())?;
    let value = device.words.words[index].1 + 1;
    stream.write_value64(device_memory(&block)?, offset, value)?;
    device.words.words[index].1 = value;
    Ok(Some(Signal { chunk: block, offset, value }))
}

fn device_memory(block: &Chunk) -> Result<&dyn DeviceMemory> {
    block.device().ok_or_else(|| Error::internal("a signal block in host memory"))
}

// Signal words in shared host memory, for receivers that cannot reach the producer's GPU (the
// staged and host routes): the producer's stream writes them through the registered mapping,
// a receiver's stream waits on them through its own registration, and a receiver without a GPU
// reads them on the CPU. One word per producer stream, as on a device.
static HOST_SIGNALS: Mutex<Words> = Mutex::new(Words::new());

/// Queues on `stream`, for each of `pieces` pieces of work, `enqueue(k)` then the write of the
/// next value of the stream's host word, and returns the word and the value after piece 0: the
/// value after piece `k` is that plus `k` (consecutive, since the lock is held throughout).
pub(crate) fn host_signal_pieces(
    stream: &Stream,
    pieces: usize,
    mut enqueue: impl FnMut(usize) -> Result<()>,
) -> Result<Signal> {
    let mut all = lock(&HOST_SIGNALS);
    let (block, offset, index) = all.word(stream.raw() as usize, || {
        // Writable by peers: a receiver whose producer died writes the awaited value itself to
        // release its stream (see `channel/fences.rs`).
        let memory = ipc_core::SharedMemory::create("tensor-queue-signals", WORDS_PER_BLOCK * 8)?;
        Chunk::writable(ChunkMemory::Host(memory))
    })?;
    let memory = block.host().ok_or_else(|| Error::internal("a host signal block on a device"))?;
    let registered = memory.registered(stream.context())?;
    let first = all.words[index].1 + 1;
    for piece in 0..pieces.max(1) {
        if piece < pieces {
            enqueue(piece)?;
        }
        let value = first + piece as u64;
        stream.write_value64(&registered, offset, value)?;
        all.words[index].1 = value;
    }
    Ok(Signal { chunk: block, offset, value: first })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_block() -> Result<Arc<Chunk>> {
        Chunk::writable(ChunkMemory::Host(ipc_core::SharedMemory::create("signal-test", WORDS_PER_BLOCK * 8)?))
    }

    /// A block made ahead (`prepare`) holds the first words; the next block is made only when it
    /// is full, and a stream keeps its word.
    #[test]
    fn a_block_made_ahead_holds_the_first_words() {
        let mut words = Words::new();
        words.blocks.push(host_block().unwrap());
        let ahead = words.blocks[0].id;
        for key in 0..WORDS_PER_BLOCK {
            let (block, offset, index) = words.word(key, || panic!("a block made for word {key}")).unwrap();
            assert_eq!((block.id, offset, index), (ahead, key * 8, key));
        }
        let (block, offset, _) = words.word(WORDS_PER_BLOCK, host_block).unwrap();
        assert!(block.id != ahead && offset == 0, "the 513th word starts a second block");
        assert_eq!(words.word(3, || panic!("stream 3 has its word")).unwrap().0.id, ahead);
        assert_eq!(words.blocks.len(), 2);
    }

    /// [`prepare`]'s flags: a device's work runs on its first call only, even when threads race
    /// for it; other devices have their own first time; an ordinal beyond the flags works every
    /// time. (The no-GPU path: there is no `Context` to call `prepare` with on this machine.)
    #[test]
    fn a_device_is_prepared_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let prepared = FirstTime::new();
        let runs: [AtomicUsize; 3] = Default::default();
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    for _ in 0..100 {
                        prepared.once(1, || {
                            runs[0].fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        prepared.once(0, || {
            runs[1].fetch_add(1, Ordering::Relaxed);
        });
        for ordinal in [FLAGGED_DEVICES as i32, FLAGGED_DEVICES as i32, -1] {
            prepared.once(ordinal, || {
                runs[2].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(runs.map(|r| r.into_inner()), [1, 1, 3]);
    }

    /// Without a block made ahead, the first word makes one.
    #[test]
    fn the_first_word_makes_the_first_block() {
        let mut words = Words::new();
        let (block, offset, index) = words.word(7, host_block).unwrap();
        assert_eq!((offset, index, words.blocks.len()), (0, 0, 1));
        assert_eq!(words.word(7, || panic!("no second block")).unwrap().0.id, block.id);
    }
}
