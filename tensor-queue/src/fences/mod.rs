//! Waiting for a producer's work, and surviving the producer's death.
//!
//! A received GPU tensor is ordered after its producer's work by a stream wait on the producer's
//! signal word (see `signal.rs`). If the producer dies before its work writes the word, the write
//! never comes, and the wait would block the receiver's stream, and every later use of it,
//! forever. So this module keeps, per producer process, each word this process waits on and the
//! highest value awaited, and a watcher thread polls a pidfd of each producer, opened when the
//! producer says hello (while it most likely lives: a pid looked up after the process was reaped
//! names nothing, or another process). A producer already gone then is dead from the start: no
//! wait on its words is ever queued, and each word is read when first named, to tell whether its
//! messages were complete. When one dies it:
//! 1. reads each word: messages fenced at or below that value were complete, the others were not;
//! 2. writes the highest awaited value itself, on a stream of its own, which releases every wait;
//! 3. records the value read, so that each message can tell whether it was complete
//!    ([`FenceWait::failed`], surfaced as [`Error::ProducerFailed`](crate::Error::ProducerFailed)
//!    by `recv` and as `Tensor::producer_failed`).
//!
//! Waits on one connection's stream never hold up another's (each connection has its own
//! stream), so a slow producer delays only its own tensors. The event fallback (devices without
//! stream memory operations) cannot be rescued this way: an interprocess event never recorded is
//! waited on forever; it only ever holds up that connection's stream.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use ipc_core::Stream;
use ipc_core::process::ProcessHandle;
use rustix::event::{PollFd, PollFlags, Timespec, poll};

use self::liveness::{Gone, Liveness};
use crate::error::Result;
use crate::memory::arena::Chunk;
use crate::sync::lock;

pub(crate) mod liveness;

/// The value a word held when its producer died (`u64::MAX` while the producer lives).
pub(crate) struct WordFate(AtomicU64);

/// The fate of a transfer another engine completes (NCCL) before it is issued on the GPU: the
/// value its wait waits for ([`FenceWait::transfer`]), so it has not failed, but is not ready.
const TRANSFER_PENDING: u64 = 1;

impl WordFate {
    /// The fate of a transfer that another engine completes (NCCL), not issued yet: its
    /// message waits on the CPU until [`WordFate::issued`] or [`WordFate::cut`].
    pub fn pending() -> Arc<WordFate> {
        Arc::new(WordFate(AtomicU64::new(TRANSFER_PENDING)))
    }

    /// The transfer is queued on the GPU, after everything its message's tensors are ordered
    /// on: whole unless cut later.
    pub fn issued(&self) {
        let _ = self.0.compare_exchange(TRANSFER_PENDING, u64::MAX, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Marks the transfer as cut short (its communicator gave up before it completed).
    pub fn cut(&self) {
        self.0.store(0, Ordering::Release);
    }
}

/// One stream wait on a producer's word: whether its producer's work completed. It keeps the
/// producer watched while the wait may still be queued.
pub(crate) struct FenceWait {
    /// `None` for a transfer that another engine completes.
    producer: Option<Arc<Producer>>,
    fate: Arc<WordFate>,
    value: u64,
    /// The word, for a wait on the CPU.
    word: Option<(Arc<Chunk>, usize)>,
}

impl FenceWait {
    /// A wait for a transfer another engine completes (NCCL): ready on the CPU once `fate` is
    /// issued, failed once it is cut.
    pub fn transfer(fate: Arc<WordFate>) -> FenceWait {
        FenceWait { producer: None, fate, value: TRANSFER_PENDING, word: None }
    }

    /// Whether its readiness on the CPU is announced on the receiver's wake (a transfer's: its
    /// NCCL worker rings when it is issued), so `recv` may block rather than look again and again.
    pub fn wakes_receiver(&self) -> bool {
        self.producer.is_none() && self.word.is_none()
    }

    /// Whether the producer died before its work reached this fence.
    pub fn failed(&self) -> bool {
        self.value > self.fate.0.load(Ordering::Acquire)
    }

    /// For a wait on the CPU: whether the host word reached its value, or its producer was found
    /// dead (then [`FenceWait::failed`] says how far it got). Never blocks: a producer that
    /// never writes holds up only its own messages.
    pub fn ready_on_cpu(&self) -> Result<bool> {
        let Some((chunk, offset)) = &self.word else {
            // A transfer's wait is ready once it is issued (or cut short).
            let pending = self.producer.is_none() && self.fate.0.load(Ordering::Acquire) == TRANSFER_PENDING;
            return Ok(!pending);
        };
        Ok(host(chunk)?.load_u64(*offset)? >= self.value || self.producer.as_ref().is_some_and(|p| p.is_dead()))
    }
}

fn host(chunk: &Chunk) -> Result<&ipc_core::SharedMemory> {
    chunk.host().ok_or_else(|| crate::error::Error::internal("a host word in device memory"))
}

/// A word of a producer's this process waits on.
struct Word {
    chunk: Arc<Chunk>,
    offset: usize,
    awaited: u64,
    fate: Arc<WordFate>,
}

/// A producer process whose fences this process waits on.
pub(crate) struct Producer {
    pid: u32,
    instance: u64,
    /// How its death is seen, opened with its first fence; `None` where pidfds are not
    /// available (its fences are then never rescued: the limitation is logged).
    process: OnceLock<Option<ProcessHandle>>,
    state: Mutex<ProducerState>,
}

#[derive(Default)]
struct ProducerState {
    dead: bool,
    words: Vec<Word>,
    /// The liveness of each connection from it, told when its process is found dead.
    connections: Vec<Weak<Liveness>>,
}

/// Producers with fences, for the watcher thread.
static PRODUCERS: Mutex<Vec<Weak<Producer>>> = Mutex::new(Vec::new());

/// The producer process `pid` (named for good by `instance`), shared by every connection from it.
/// For a sender of this machine (`local`), its pidfd is opened now, if it was not already.
pub(crate) fn producer(pid: u32, instance: u64, local: bool) -> Arc<Producer> {
    let producer = registered(pid, instance);
    if local {
        producer.open(&mut lock(&producer.state));
    }
    producer
}

fn registered(pid: u32, instance: u64) -> Arc<Producer> {
    let mut all = lock(&PRODUCERS);
    all.retain(|p| p.strong_count() > 0);
    if let Some(found) = all.iter().filter_map(Weak::upgrade).find(|p| p.pid == pid && p.instance == instance) {
        return found;
    }
    let producer =
        Arc::new(Producer { pid, instance, process: OnceLock::new(), state: Mutex::new(ProducerState::default()) });
    all.push(Arc::downgrade(&producer));
    producer
}

impl Producer {
    /// Makes `stream` wait until the word at `offset` of `chunk` reaches `value`, unless the
    /// producer already died (then nothing is queued: the word will never move again).
    pub fn wait(self: &Arc<Self>, stream: &Stream, chunk: &Arc<Chunk>, offset: usize, value: u64) -> Result<FenceWait> {
        self.fence(Some(stream), chunk, offset, value)
    }

    /// Notes that this process waits on the CPU (see [`FenceWait::wait_on_cpu`]) until the word at
    /// `offset` of the host chunk `chunk` reaches `value`.
    pub fn wait_on_cpu(self: &Arc<Self>, chunk: &Arc<Chunk>, offset: usize, value: u64) -> Result<FenceWait> {
        if chunk.host().is_none() {
            return Err(crate::error::Error::internal("a CPU wait on device memory"));
        }
        self.fence(None, chunk, offset, value)
    }

    fn fence(
        self: &Arc<Self>,
        stream: Option<&Stream>,
        chunk: &Arc<Chunk>,
        offset: usize,
        value: u64,
    ) -> Result<FenceWait> {
        let mut state = lock(&self.state);
        let at = match state.words.iter().position(|w| w.chunk.id == chunk.id && w.offset == offset) {
            Some(at) => at,
            None => {
                self.open(&mut state);
                Watcher::start();
                if !state.dead && self.process().is_some_and(|p| !p.is_alive().unwrap_or(true)) {
                    // Exited (not reaped yet) before the watcher heard: rescue its words now,
                    // so that no wait on this one is queued.
                    self.rescue_locked(&mut state);
                }
                let fate = Arc::new(WordFate(AtomicU64::new(u64::MAX)));
                state.words.push(Word { chunk: chunk.clone(), offset, awaited: 0, fate });
                state.words.len() - 1
            }
        };
        let fate = state.words[at].fate.clone();
        if !state.dead {
            if let Some(stream) = stream {
                match chunk.device() {
                    Some(memory) => stream.wait_value64(memory, offset, value)?,
                    None => stream.wait_value64(&host(chunk)?.registered(stream.context())?, offset, value)?,
                }
            }
            let word = &mut state.words[at];
            word.awaited = word.awaited.max(value);
        } else if fate.0.load(Ordering::Acquire) == u64::MAX {
            // A word first named after the producer died: how far did it get?
            rescue_word(&state.words[at])?;
        }
        Ok(FenceWait {
            producer: Some(self.clone()),
            fate,
            value,
            word: stream.is_none().then(|| (chunk.clone(), offset)),
        })
    }

    fn is_dead(&self) -> bool {
        lock(&self.state).dead
    }

    /// Has `liveness` (of a connection from this producer) told when the process is found dead
    /// (at once if it already was).
    pub fn report_to(&self, liveness: &Arc<Liveness>) {
        let mut state = lock(&self.state);
        if state.dead {
            liveness.report(Gone::Exited);
            return;
        }
        state.connections.retain(|c| c.strong_count() > 0);
        state.connections.push(Arc::downgrade(liveness));
    }

    /// Opens the producer's pidfd, once. A producer that no longer exists is dead from now on.
    fn open(&self, state: &mut ProducerState) {
        self.process.get_or_init(|| match ProcessHandle::open(self.pid) {
            Ok(process) => Some(process),
            Err(ipc_core::Error::NoSuchProcess { .. }) => {
                tracing::debug!(pid = self.pid, "a producer was gone before its fences were seen");
                state.dead = true;
                None
            }
            Err(error) => {
                let pid = self.pid;
                tracing::warn!(pid, %error, "cannot watch a producer: if it dies with GPU work queued, waits on it stay");
                None
            }
        });
    }

    fn process(&self) -> Option<&ProcessHandle> {
        self.process.get().and_then(Option::as_ref)
    }

    /// The producer is dead: note how far each word got, and release every wait on it.
    fn rescue(&self) {
        self.rescue_locked(&mut lock(&self.state));
    }

    fn rescue_locked(&self, state: &mut ProducerState) {
        if state.dead {
            return;
        }
        state.dead = true;
        for liveness in state.connections.drain(..).filter_map(|c| c.upgrade()) {
            liveness.report(Gone::Exited);
        }
        let mut abandoned = 0;
        for word in &state.words {
            match rescue_word(word) {
                Ok(true) => abandoned += 1,
                Ok(false) => {}
                Err(error) => tracing::warn!(pid = self.pid, %error, "releasing a dead producer's fence failed"),
            }
        }
        if abandoned > 0 {
            tracing::warn!(pid = self.pid, abandoned, "a producer died with GPU work unfinished; its waits released");
        }
    }
}

/// Reads `word`, records it, and writes the highest awaited value if the word is short of it.
/// Whether it was short (some message's work never completed).
fn rescue_word(word: &Word) -> Result<bool> {
    if let Some(memory) = word.chunk.host() {
        // Host memory (the staged and host routes): the CPU reads and writes it; streams waiting
        // on it through a registration see the write.
        let reached = memory.load_u64(word.offset)?;
        word.fate.0.store(reached, Ordering::Release);
        if reached >= word.awaited {
            return Ok(false);
        }
        memory.store_u64(word.offset, word.awaited)?;
        return Ok(true);
    }
    let memory = word.chunk.device().ok_or_else(|| crate::error::Error::internal("a signal word nowhere"))?;
    // A stream of its own: the receiving streams are blocked on this very word.
    let stream = Stream::new(memory.context())?;
    let reached = stream.read_value64(memory, word.offset)?;
    word.fate.0.store(reached, Ordering::Release);
    if reached >= word.awaited {
        return Ok(false);
    }
    stream.write_value64(memory, word.offset, word.awaited)?;
    stream.synchronize()?;
    Ok(true)
}

/// The fences of one message.
pub(crate) type Fences = Arc<Vec<FenceWait>>;

/// Whether the producer died before its work reached any of `fences`.
pub(crate) fn failed(fences: &Fences) -> bool {
    fences.iter().any(FenceWait::failed)
}

/// The thread that watches producers' pidfds.
struct Watcher;

/// How often the watcher looks for new producers to watch.
const WATCH_TICK: Duration = Duration::from_millis(50);

impl Watcher {
    fn start() {
        static STARTED: OnceLock<()> = OnceLock::new();
        STARTED.get_or_init(|| {
            if let Err(error) = std::thread::Builder::new().name("tq-fences".into()).spawn(Watcher::run) {
                tracing::warn!(%error, "no fence watcher: a producer's death will not release waits on it");
            }
        });
    }

    fn run() {
        loop {
            let watched: Vec<Arc<Producer>> = lock(&PRODUCERS)
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|p| p.process().is_some() && !lock(&p.state).dead)
                .collect();
            let mut fds: Vec<PollFd<'_>> = watched
                .iter()
                .filter_map(|p| p.process())
                .map(|process| PollFd::from_borrowed_fd(process.as_fd(), PollFlags::IN))
                .collect();
            let tick = Timespec::try_from(WATCH_TICK).ok();
            if fds.is_empty() {
                std::thread::sleep(WATCH_TICK);
                continue;
            }
            if poll(&mut fds, tick.as_ref()).unwrap_or(0) == 0 {
                continue;
            }
            let exited: Vec<bool> = fds.iter().map(|fd| !fd.revents().is_empty()).collect();
            drop(fds);
            for (producer, exited) in watched.iter().zip(exited) {
                if exited {
                    producer.rescue();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;
    use crate::memory::arena::ChunkMemory;

    /// A host word, as the host and staged routes use.
    fn host_word() -> Arc<Chunk> {
        let memory = ipc_core::SharedMemory::create("tq-fences-test", 4096).unwrap();
        Chunk::writable(ChunkMemory::Host(memory)).unwrap()
    }

    /// A producer that exited and was reaped before its hello was read (its pid names nothing
    /// now): its messages whose word it wrote are complete, the others failed and never waited for.
    #[test]
    fn a_producer_reaped_before_its_hello_is_dead() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let producer = producer(pid, 0xdead, true);
        let chunk = host_word();
        chunk.host().unwrap().store_u64(8, 5).unwrap();
        let unfinished = producer.wait_on_cpu(&chunk, 0, 1).unwrap();
        assert!(unfinished.ready_on_cpu().unwrap(), "no wait on a dead producer");
        assert!(unfinished.failed(), "its word never reached the message's value");
        let finished = producer.wait_on_cpu(&chunk, 8, 5).unwrap();
        assert!(finished.ready_on_cpu().unwrap() && !finished.failed(), "written before it died: complete");
    }

    /// A producer that exited (not reaped yet) before its first fence is rescued at that fence,
    /// without waiting for the watcher.
    #[test]
    fn a_producer_exited_before_its_first_fence_is_rescued_at_once() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let producer = producer(child.id(), 0xbeef, true);
        child.kill().unwrap();
        // Exited once its pidfd says so; not reaped: the pid stays its own.
        let process = ProcessHandle::open(child.id()).unwrap();
        while process.is_alive().unwrap() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let chunk = host_word();
        let wait = producer.wait_on_cpu(&chunk, 0, 3).unwrap();
        assert!(wait.failed() && wait.ready_on_cpu().unwrap());
        child.wait().unwrap();
    }

    /// A live producer's fence waits for its word, and is complete once it is written.
    #[test]
    fn a_live_producer_is_waited_for() {
        let producer = producer(std::process::id(), 0xa11e, true);
        let chunk = host_word();
        let wait = producer.wait_on_cpu(&chunk, 16, 2).unwrap();
        assert!(!wait.ready_on_cpu().unwrap() && !wait.failed());
        chunk.host().unwrap().store_u64(16, 2).unwrap();
        assert!(wait.ready_on_cpu().unwrap() && !wait.failed());
    }
}
