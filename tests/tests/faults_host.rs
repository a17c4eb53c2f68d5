//! A producer SIGKILLed on a TCP channel carrying host tensors (issue 21): no GPU needed, so CI
//! runs it. The producer is `tq-fault batch --host` (`tests/src/bin/tq-fault.rs`), a separate
//! program, sending one message of several tensors to this process's receiver at
//! `tcp://127.0.0.1:PORT` (the secret in `TQ_SECRET`), killed at each moment: with its message
//! written, before the receiver's first `recv`; in the middle of writing a message too large for
//! the sockets' buffers while the receiver does not read; and in the middle of writing while the
//! receiver reads. Each case checks what a user sees: the message is refused
//! (`Error::ProducerFailed`), delivered flagged, or delivered whole with the producer's bytes;
//! never a hang or wrong bytes unflagged; `recv` then says `Disconnected`, a lost message leaves
//! an entry in `take_errors()`, and a new producer's message arrives intact. The GPU cases (GPU
//! tensors over TCP and NCCL) are in `faults_gpu.rs`.
//!
//! Seeds are printed and replayable: `TQ_FAULT_SEED=N`; `TQ_FAULT_CASES=Tcp/MidFrame` runs only
//! the cases named.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::bin_path;
use integration_tests::queue::{BatchArgs, FaultBatch, case_seed, checksum, take_doomed, wait_for};
use kernels::reference;
use tensor_queue::{Error, Receiver, SECRET_ENV, Secret, TransferPath};

/// The shared secret of these tests' TCP channels.
const KEY: &str = "faults-host-tests-shared-secret-0123456789";

const MIB: usize = 1 << 20;

/// When the producer is killed (host tensors over TCP: no GPU work, no device copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Moment {
    /// Its message of 4 x 256 KiB written (`send` returned), killed and reaped before the
    /// receiver's first `recv`.
    BeforeRecv,
    /// In the middle of writing a 64 MiB message (4 x 16 MiB) while the receiver reads nothing:
    /// the sockets' buffers hold a few MiB, so its writer is stuck mid-frame when it dies; the
    /// message cannot arrive and must be reported lost.
    MidFrame,
    /// 20 ms after its send of a 64 MiB message returned, while its link still writes it and the
    /// receiver reads (it kills itself: `tq-fault batch --die-after-us`).
    MidFrameReading,
}

/// What one case saw of the killed producer's message.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// `recv` said `Error::ProducerFailed`.
    Refused,
    /// Delivered with every byte the producer's.
    Whole,
    /// Delivered with `producer_failed()` true.
    Flagged,
    /// Not delivered; `take_errors()` said why.
    Lost,
}

/// A running `tq-fault`: its stdout lines, and a SIGKILL when it goes out of scope.
struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    said: Vec<String>,
}

impl Proc {
    fn start(name: &str, args: &[String]) -> Result<Proc> {
        let mut child = Command::new(bin_path("tq-fault")?)
            .args(args)
            .env(SECRET_ENV, KEY)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting tq-fault for {name}"))?;
        let lines = integration_tests::stdout_lines(&mut child, None);
        Ok(Proc { name: format!("{name} ({})", child.id()), child, lines, said: Vec::new() })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn poll(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.said.push(line);
        }
    }

    fn has_said(&self, line: &str) -> bool {
        self.said.iter().any(|l| l == line)
    }

    fn tail(&self) -> String {
        let start = self.said.len().saturating_sub(10);
        format!("{} said {:?}", self.name, &self.said[start..])
    }

    /// Waits up to `timeout` for the line `line`.
    fn wait_said(&mut self, line: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !self.has_said(line) {
            ensure!(
                Instant::now() < deadline,
                "{} did not say {line:?} within {timeout:?}; {}",
                self.name,
                self.tail()
            );
            if let Ok(l) = self.lines.recv_timeout(Duration::from_millis(10)) {
                self.said.push(l);
            }
        }
        Ok(())
    }

    /// Waits up to `timeout` for it to exit, taking in its lines.
    fn exit_within(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll();
            if let Some(status) = self.child.try_wait()? {
                // Its last lines.
                while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.said.push(line);
                }
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn sigkill(&mut self) -> Result<()> {
        if self.child.try_wait()?.is_none() {
            self.child.kill().with_context(|| format!("killing {}", self.name))?;
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The CPU time (user and system, in clock ticks) process `pid` has used so far.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')').context("a /proc stat line")?.1.split_whitespace().collect();
    let ticks = |i: usize| -> Result<u64> { Ok(fields.get(i).context("a short /proc stat line")?.parse::<u64>()?) };
    Ok(ticks(11)? + ticks(12)?) // utime and stime, fields 14 and 15 of the line
}

/// Waits until process `pid` uses no CPU for 300 ms (all its threads wait), for up to `timeout`.
fn wait_blocked(pid: u32, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    let (mut last, mut still_since) = (cpu_ticks(pid)?, Instant::now());
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = cpu_ticks(pid)?;
        if now != last {
            (last, still_since) = (now, Instant::now());
        } else if still_since.elapsed() >= Duration::from_millis(300) {
            return Ok(());
        }
        ensure!(start.elapsed() < timeout, "pid {pid} kept using CPU for {timeout:?}");
    }
}

/// `tq-fault batch --host` to `endpoint`: `tensors` of `len` bytes, tensor `k` the pattern of
/// `seed + k`; `die_after_us` (not 0): it kills itself that long after its send returned.
fn batch_args(endpoint: &str, seed: u64, tensors: usize, len: usize, die_after_us: u64) -> Vec<String> {
    BatchArgs { host: true, die_after_us, deadline_s: Some(60), ..BatchArgs::new(endpoint, tensors, len, seed) }
        .to_args()
}

/// Kills a `tq-fault batch --host` producer at `moment` and checks what the receiver sees (see
/// the module's comment).
fn killed_case(moment: Moment, seed: u64) -> Result<Outcome> {
    let mut receiver =
        Receiver::<FaultBatch>::builder().secret(Secret::from_bytes(KEY.as_bytes())?).bind("tcp://127.0.0.1:0")?;
    let endpoint = format!("tcp://{}", receiver.local_addr().context("a TCP receiver's address")?);
    // Before the receiver's `recv` it kills itself 200 ms after its send returned (host tensors
    // are written by then; it would exit on its own soon after).
    let (tensors, len, die_after) = match moment {
        Moment::BeforeRecv => (4, 256 << 10, 200_000),
        Moment::MidFrame => (4, 16 * MIB, 0),
        Moment::MidFrameReading => (4, 16 * MIB, 20_000),
    };
    let args = batch_args(&endpoint, seed, tensors, len, die_after);
    let mut doomed = Proc::start("doomed producer", &args)?;
    let (mut held, mut refused) = (Vec::new(), 0);
    match moment {
        Moment::BeforeRecv => {
            // The handshake needs no `recv`: the receiver has read nothing of it when it dies.
            doomed.wait_said("sent", Duration::from_secs(30))?;
            ensure!(doomed.exit_within(Duration::from_secs(30))?.is_some(), "it outlived its own SIGKILL");
        }
        Moment::MidFrame => {
            // Its send encodes the message and its link writes until the sockets' buffers are
            // full, then waits for the reader that never comes (`send` may have returned: the
            // rest is written in the background, and the sender waits for it before it exits):
            // once it uses no more CPU, it is stuck mid-frame; kill it then.
            doomed.wait_said("sending", Duration::from_secs(30))?;
            wait_blocked(doomed.pid(), Duration::from_secs(30))?;
            ensure!(doomed.child.try_wait()?.is_none(), "it ended with 64 MiB nobody read; {}", doomed.tail());
            doomed.sigkill()?;
        }
        Moment::MidFrameReading => {
            let start = Instant::now();
            while doomed.child.try_wait()?.is_none() {
                ensure!(start.elapsed() < Duration::from_secs(30), "it did not die within 30 s; {}", doomed.tail());
                take_doomed(&mut receiver, doomed.pid(), &mut held, &mut refused, Duration::from_micros(200))?;
                doomed.poll();
            }
        }
    }
    let killed_at = Instant::now();
    let status = doomed.exit_within(Duration::from_secs(10))?;
    use std::os::unix::process::ExitStatusExt as _;
    ensure!(status.and_then(|s| s.signal()) == Some(9), "the doomed producer ended with {status:?}; {}", doomed.tail());
    // Its message (if any), then the end of its connection.
    loop {
        ensure!(killed_at.elapsed() < Duration::from_secs(30), "30 s after the kill, no Disconnected");
        if take_doomed(&mut receiver, doomed.pid(), &mut held, &mut refused, Duration::from_millis(100))? {
            break;
        }
    }
    let errors = receiver.take_errors();
    ensure!(held.len() + refused <= 1, "its one message came {} times and was refused {refused} times", held.len());
    let outcome = match held.first() {
        None if refused == 1 => Outcome::Refused,
        None => {
            ensure!(!errors.is_empty(), "its message was neither delivered nor refused, and take_errors() is empty");
            Outcome::Lost
        }
        Some(batch) => {
            ensure!(batch.tensors.len() == tensors, "{} tensors of {tensors}", batch.tensors.len());
            let mut intact = true;
            for (k, tensor) in batch.tensors.iter().enumerate() {
                ensure!(tensor.path() == TransferPath::Tcp, "tensor {k} came by {:?}", tensor.path());
                ensure!(tensor.nbytes() == len, "tensor {k} has {} bytes", tensor.nbytes());
                intact &= checksum(tensor)? == reference::checksum(&reference::pattern(len, batch.seed + k as u64));
            }
            let settle = if intact { Duration::ZERO } else { Duration::from_secs(2) };
            let flagged = batch.tensors.iter().all(|t| wait_for(settle, || t.producer_failed()).is_some());
            match (intact, flagged) {
                (_, true) => Outcome::Flagged,
                (true, false) => Outcome::Whole,
                (false, false) => bail!("a killed producer's message was delivered with wrong bytes, not flagged"),
            }
        }
    };
    if moment == Moment::MidFrame {
        ensure!(outcome == Outcome::Lost, "a 64 MiB message the receiver never read came whole: {outcome:?}");
    }
    println!("  Tcp killed {moment:?}: {outcome:?}; errors: {errors:?}");
    drop(held);

    // A new producer: its message arrives intact.
    let healthy_seed = seed ^ 0x5a5a;
    let mut healthy = Proc::start("healthy producer", &batch_args(&endpoint, healthy_seed, 2, MIB, 0))?;
    let start = Instant::now();
    let batch = loop {
        ensure!(start.elapsed() < Duration::from_secs(30), "no healthy message within 30 s; {}", healthy.tail());
        match receiver.recv_timeout(Duration::from_millis(100)) {
            Ok(batch) => break batch,
            Err(Error::Timeout | Error::Disconnected) => healthy.poll(),
            Err(error) => bail!("recv of the healthy message: {error:?}; {}", healthy.tail()),
        }
    };
    ensure!(batch.seed == healthy_seed && batch.tensors.len() == 2, "the healthy message is another's");
    for (k, tensor) in batch.tensors.iter().enumerate() {
        let expected = reference::checksum(&reference::pattern(MIB, healthy_seed + k as u64));
        ensure!(checksum(tensor)? == expected, "healthy tensor {k}: wrong bytes");
        ensure!(!tensor.producer_failed(), "the healthy producer's tensor is flagged");
    }
    drop(batch);
    let status = healthy.exit_within(Duration::from_secs(30))?;
    ensure!(status.is_some_and(|s| s.success()), "the healthy producer ended with {status:?}; {}", healthy.tail());
    ensure!(healthy.has_said("released"), "{}", healthy.tail());
    ensure!(receiver.take_errors().is_empty(), "a healthy producer's goodbye reported an error");
    Ok(outcome)
}

/// Runs the cases of `moments`, each with its own seed from [`case_seed`]: all, then every failure.
/// `TQ_FAULT_CASES` (for example `Tcp/MidFrame`) runs only those named.
fn killed_cases(moments: &[Moment]) -> Result<()> {
    let seed = case_seed()?;
    let only = std::env::var("TQ_FAULT_CASES").ok();
    let mut failures = Vec::new();
    for (n, &moment) in moments.iter().enumerate() {
        if only.as_ref().is_some_and(|only| !only.split(',').any(|c| c == format!("Tcp/{moment:?}"))) {
            continue;
        }
        if let Err(error) = killed_case(moment, (seed << 8) + n as u64 * 16) {
            println!("  Tcp killed {moment:?}: FAILED: {error:#}");
            failures.push(format!("Tcp killed {moment:?}: {error:#}"));
        }
    }
    ensure!(
        failures.is_empty(),
        "{} of {} cases failed (seed {seed}):\n{}",
        failures.len(),
        moments.len(),
        failures.join("\n")
    );
    Ok(())
}

/// A producer SIGKILLed on a TCP channel of host tensors, at each moment (with its message
/// written, before the receiver's first `recv`; in the middle of writing a large frame, the
/// receiver not reading, then reading): see [`killed_case`].
#[test]
fn producer_killed_on_a_tcp_channel_at_every_moment() -> Result<()> {
    killed_cases(&[Moment::BeforeRecv, Moment::MidFrame, Moment::MidFrameReading])
}
