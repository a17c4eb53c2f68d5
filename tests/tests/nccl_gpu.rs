//! NCCL between two processes, one GPU each: this process is rank 0 on GPU 0, `nccl-peer` (started
//! by exec, never forked) rank 1 on GPU 1. Without two GPUs each test is reported as `ignored, no
//! GPU here: ...`, never as a pass.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::{GpuTest, bin_path, run_gpu_tests, to_hex};
use ipc_core::nccl::{Communicator, UniqueId};
use ipc_core::{Context, DeviceBuffer, Stream};
use kernels::{Kernels, reference};

/// The bound on initialising a communicator and on each wait.
const TIMEOUT: Duration = Duration::from_secs(30);

/// How long the peer may take to answer a line; longer is a hang.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(90);

fn main() {
    run_gpu_tests(vec![
        GpuTest {
            name: "nccl_moves_64_mib_between_two_processes",
            gpus: 2,
            run: nccl_moves_64_mib_between_two_processes,
        },
        GpuTest { name: "a_killed_peer_is_noticed_and_aborted", gpus: 2, run: a_killed_peer_is_noticed_and_aborted },
        GpuTest { name: "one_rank_releasing_alone_is_bounded", gpus: 2, run: one_rank_releasing_alone_is_bounded },
    ]);
}

/// Ends the process if the returned flag is not set within `bound`: a hang is the failure the
/// tests that use it exist for, and must not stall the whole run.
fn watchdog(test: &'static str, bound: Duration) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    std::thread::spawn(move || {
        std::thread::sleep(bound);
        if !flag.load(Ordering::SeqCst) {
            eprintln!("{test}: hung for {bound:?}");
            std::process::exit(3);
        }
    });
    done
}

/// The other rank: its standard input takes commands, its standard output's lines come back here.
struct Peer {
    child: Child,
    input: ChildStdin,
    lines: Receiver<String>,
}

impl Peer {
    /// Starts `nccl-peer` on GPU 1 and hands it the communicator's id.
    fn spawn(id: &UniqueId) -> Result<Peer> {
        let mut child = Command::new(bin_path("nccl-peer")?)
            .args(["--device", "1", "--timeout-s", &TIMEOUT.as_secs().to_string()])
            // NVLink SHARP (multicast) is off on the lent machines (GPU.md).
            .env("NCCL_NVLS_ENABLE", "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting nccl-peer")?;
        let input = child.stdin.take().context("no stdin")?;
        let output = child.stdout.take().context("no stdout")?;
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(output).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut peer = Peer { child, input, lines };
        peer.say(&to_hex(&id.to_bytes()))?;
        Ok(peer)
    }

    fn say(&mut self, line: &str) -> Result<()> {
        writeln!(self.input, "{line}").and_then(|()| self.input.flush()).context("writing to nccl-peer")
    }

    /// The peer's next line.
    fn answer(&mut self) -> Result<String> {
        match self.lines.recv_timeout(ANSWER_TIMEOUT) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => bail!("nccl-peer did not answer within {ANSWER_TIMEOUT:?}"),
            Err(RecvTimeoutError::Disconnected) => bail!("nccl-peer exited ({:?}); see its stderr", self.child.wait()),
        }
    }

    fn expect(&mut self, wanted: &str) -> Result<()> {
        let line = self.answer()?;
        ensure!(line == wanted, "nccl-peer said {line:?}, expected {wanted:?}");
        Ok(())
    }

    /// Asks the peer to receive `len` bytes from rank 0.
    fn receive(&mut self, len: usize) -> Result<()> {
        self.say(&format!("recv {len}"))
    }

    /// The checksum the peer computed of what it received.
    fn checksum(&mut self) -> Result<u64> {
        let line = self.answer()?;
        let hex = line.strip_prefix("checksum ").with_context(|| format!("nccl-peer said {line:?}"))?;
        Ok(u64::from_str_radix(hex, 16)?)
    }

    /// Waits for the `bye` that follows a `quit`, and for the peer to exit successfully.
    fn quit(mut self) -> Result<()> {
        self.expect("bye")?;
        let status = self.child.wait()?;
        ensure!(status.success(), "nccl-peer exited with {status}");
        Ok(())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Rank 0 on GPU 0, with rank 1 started and joined.
struct Rank0 {
    communicator: Communicator,
    peer: Peer,
    context: Arc<Context>,
    stream: Stream,
    kernels: Arc<Kernels>,
}

fn connect() -> Result<Rank0> {
    let id = UniqueId::new()?;
    let mut peer = Peer::spawn(&id)?;
    let context = Context::on_ordinal(0)?;
    let started = Instant::now();
    let communicator = Communicator::init(&context, &id, 2, 0, TIMEOUT)?;
    peer.expect("ready")?;
    let found = cuda_sys::nccl::library()?;
    eprintln!("NCCL {} from {}: communicator up in {:?}", found.version(), found.path().display(), started.elapsed());
    let stream = Stream::new(&context)?;
    let kernels = Kernels::get(&context)?;
    Ok(Rank0 { communicator, peer, context, stream, kernels })
}

impl Rank0 {
    /// Sends `len` bytes of the pattern `seed`; checks the peer's checksum against this side's.
    fn send_checked(&mut self, len: usize, seed: u64) -> Result<()> {
        let buffer = DeviceBuffer::alloc(&self.context, len)?;
        self.kernels.fill(&buffer, 0, len, seed, &self.stream)?;
        let expected = self.kernels.checksum(&buffer, 0, len, &self.stream)?;
        self.peer.receive(len)?;
        let started = Instant::now();
        self.communicator.send(&buffer, 0, len, 1, &self.stream)?;
        self.communicator.wait(&self.stream)?;
        let elapsed = started.elapsed();
        let received = self.peer.checksum()?;
        ensure!(received == expected, "{len} bytes: rank 1 checksum {received:#x}, sent {expected:#x}");
        eprintln!("{len} bytes sent and checked ({elapsed:?} from the send call to the stream's end)");
        Ok(())
    }

    /// Receives `len` bytes of the pattern `seed` from the peer; checks them against its checksum.
    fn receive_checked(&mut self, len: usize, seed: u64) -> Result<()> {
        let buffer = DeviceBuffer::alloc(&self.context, len)?;
        self.peer.say(&format!("send {len} {seed}"))?;
        self.communicator.recv(&buffer, 0, len, 1, &self.stream)?;
        self.communicator.wait(&self.stream)?;
        let received = self.kernels.checksum(&buffer, 0, len, &self.stream)?;
        let sent = self.peer.checksum()?;
        ensure!(received == sent, "{len} bytes: received checksum {received:#x}, rank 1 sent {sent:#x}");
        Ok(())
    }
}

fn nccl_moves_64_mib_between_two_processes() -> Result<()> {
    let mut rank0 = connect()?;
    rank0.send_checked(64 << 20, 7)?;
    rank0.send_checked(4099, 8)?;
    // Both ranks release their communicators at once, as they would in use.
    let Rank0 { communicator, mut peer, .. } = rank0;
    peer.say("quit")?;
    let started = Instant::now();
    drop(communicator);
    eprintln!("rank 0 released its communicator in {:?}", started.elapsed());
    peer.quit()
}

fn a_killed_peer_is_noticed_and_aborted() -> Result<()> {
    let mut rank0 = connect()?;
    // Both directions connected and checked, so what follows waits on data, not on a connection.
    rank0.send_checked(1 << 20, 9)?;
    rank0.receive_checked(1 << 20, 12)?;

    // A receive the peer never sends to, its kernel running on the survivor's stream, then the
    // peer dies. (Not a send: NCCL completes a send once its bytes are in the receiver's buffers,
    // which hold tens of MiB over NVLink.)
    let len = 64 << 20;
    let buffer = DeviceBuffer::alloc(&rank0.context, len)?;
    rank0.communicator.recv(&buffer, 0, len, 1, &rank0.stream)?;
    ensure!(!rank0.stream.is_idle()?, "a receive with no sender finished");
    rank0.peer.child.kill()?;
    let status = rank0.peer.child.wait()?;
    eprintln!("nccl-peer killed ({status})");

    // The survivor's wait, abort and recovery must return within a generous bound.
    let done = watchdog("a_killed_peer_is_noticed_and_aborted", TIMEOUT + Duration::from_secs(90));
    let started = Instant::now();
    let outcome = rank0.communicator.wait(&rank0.stream);
    let error = match outcome {
        Ok(()) => bail!("a receive from a dead peer completed"),
        Err(error) => error,
    };
    eprintln!("the survivor saw, after {:?}: {error}", started.elapsed());
    ensure!(rank0.communicator.is_aborted(), "the communicator was not aborted after {error}");
    ensure!(
        matches!(rank0.communicator.check_async(), Err(ipc_core::Error::NcclAborted)),
        "calls after the abort must say so"
    );

    // The survivor's GPU is unharmed: the stream drains, and new work runs and is right.
    rank0.stream.synchronize().context("the survivor's stream after the abort")?;
    let len = 1 << 20;
    let fresh = DeviceBuffer::alloc(&rank0.context, len)?;
    rank0.kernels.fill(&fresh, 0, len, 11, &rank0.stream)?;
    let checksum = rank0.kernels.checksum(&fresh, 0, len, &rank0.stream)?;
    ensure!(checksum == reference::checksum(&reference::pattern(len, 11)), "the survivor's GPU computes wrongly");
    done.store(true, Ordering::SeqCst);
    eprintln!("survivor recovered {:?} after its peer died", started.elapsed());
    Ok(())
}

/// Rank 0 releases its communicator while rank 1 still holds its own, then rank 1 releases alone:
/// each release returns within its bound, by finalizing or, failing that, by aborting.
fn one_rank_releasing_alone_is_bounded() -> Result<()> {
    let mut rank0 = connect()?;
    rank0.send_checked(1 << 20, 13)?;
    let done = watchdog("one_rank_releasing_alone_is_bounded", TIMEOUT + Duration::from_secs(90));
    let Rank0 { communicator, mut peer, .. } = rank0;
    let started = Instant::now();
    drop(communicator);
    eprintln!("rank 0 released its communicator alone in {:?}", started.elapsed());
    peer.say("quit")?;
    peer.quit()?;
    done.store(true, Ordering::SeqCst);
    Ok(())
}
