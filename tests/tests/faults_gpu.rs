//! tensor-queue with GPU tensors when things go wrong: many senders in one process, producers and
//! consumers SIGKILLed mid-stream, and device memory going back to the driver. The second
//! processes are `tq-fault` (`tests/src/bin/tq-fault.rs`); every wait has a deadline, every
//! child is killed at the end of its test, pass or fail, and every byte is checked on the GPU.
//! Where there is no GPU each test is reported as ignored with the reason.

use std::collections::{HashMap, HashSet};

use std::os::unix::process::ExitStatusExt as _;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use integration_tests::queue::{
    BatchArgs, FaultBatch, FaultItem, case_seed, checksum, fault_seed, take_doomed, wait_for,
};
use integration_tests::{GpuTest, bin_path, run_gpu_tests, socket_path};
use ipc_core::{Context, DeviceBuffer, Stream};
use kernels::{Kernels, reference};
use serde::Serialize;
use tensor_queue::route::{Landing, PeerMode, Routing};
use tensor_queue::{DType, Error, Receiver, Tensor, TransferPath, memory};

fn main() {
    run_gpu_tests(vec![
        GpuTest { name: "eight_senders_in_one_process", gpus: 1, run: eight_senders_in_one_process },
        GpuTest { name: "producer_killed_with_work_queued", gpus: 1, run: producer_killed_with_work_queued },
        GpuTest { name: "memory_goes_back_to_the_driver", gpus: 1, run: memory_goes_back_to_the_driver },
        GpuTest { name: "fault_suite", gpus: 1, run: fault_suite },
        GpuTest { name: "producer_killed_on_every_route_of_one_gpu", gpus: 1, run: killed_on_one_gpu },
        GpuTest { name: "host_landing_delivers_whole_tensors", gpus: 1, run: host_landing_delivers_whole_tensors },
        GpuTest { name: "producer_killed_on_every_route_across_gpus", gpus: 2, run: killed_across_gpus },
    ]);
}

const MIB: usize = 1 << 20;

/// How long a received tensor's stream may take to become usable before the test calls it stuck.
const USABLE_WITHIN: Duration = Duration::from_secs(5);

/// `(tag, thread, index)` of a seed made by [`fault_seed`].
fn decode_seed(seed: u64) -> (u64, u64, u64) {
    (seed >> 40, (seed >> 32) & 0xff, seed & 0xffff_ffff)
}

/// The checksum of `len` bytes of the pattern of `seed`, on the CPU.
fn expected(len: usize, seed: u64) -> u64 {
    reference::checksum(&reference::pattern(len, seed))
}

/// Runs `work` on a thread and gives its result within `timeout`, or an error naming `what` (the
/// thread is left behind; the test's children are killed when it ends).
fn within<R: Send + 'static>(
    timeout: Duration,
    what: &str,
    work: impl FnOnce() -> Result<R> + Send + 'static,
) -> Result<R> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(work());
    });
    rx.recv_timeout(timeout).map_err(|_| anyhow!("{what} did not finish within {timeout:?}"))?
}

/// The context of GPU 0 with the kernels loaded.
fn gpu() -> Result<Arc<Context>> {
    let context = Context::on_ordinal(0)?;
    Kernels::get(&context)?;
    Ok(context)
}

/// A kernel and a sync on a fresh stream succeed within 10 s: no sticky CUDA error.
fn cuda_ok(context: &Arc<Context>) -> Result<()> {
    let context = context.clone();
    within(Duration::from_secs(10), "a kernel and a sync on a fresh stream", move || {
        let stream = Stream::new(&context)?;
        let buffer = DeviceBuffer::alloc(&context, 4096)?;
        let kernels = Kernels::get(&context)?;
        kernels.fill(&buffer, 0, 4096, 4242, &stream)?;
        let sum = kernels.checksum(&buffer, 0, 4096, &stream)?;
        ensure!(sum == expected(4096, 4242), "a fresh kernel computed {sum:#x}");
        Ok(())
    })
    .context("the context is not usable any more")
}

/// A received tensor's checksum on the GPU, after waiting (at most [`USABLE_WITHIN`]) for its
/// stream to pass its producer's fence.
fn bounded_checksum(tensor: &Tensor) -> Result<u64> {
    let stream = tensor.stream().context("a received GPU tensor has a stream")?;
    let start = Instant::now();
    while !stream.is_idle()? {
        ensure!(start.elapsed() < USABLE_WITHIN, "a received tensor was not usable within {USABLE_WITHIN:?}");
        std::thread::sleep(Duration::from_micros(50));
    }
    checksum(tensor)
}

/// Free device memory as the driver reports it.
fn free_bytes(context: &Context) -> Result<usize> {
    Ok(context.memory_info()?.0)
}

/// This process's open file descriptors.
fn open_fds() -> Result<usize> {
    Ok(std::fs::read_dir("/proc/self/fd")?.count())
}

/// Bytes as MiB, signed, for printing.
fn mib(bytes: i64) -> f64 {
    bytes as f64 / MIB as f64
}

/// A running `tq-fault`: its stdout lines, its stdin, and a SIGKILL when it goes out of scope.
struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every line it said so far.
    said: Vec<String>,
    /// How many of them start with `sent `.
    sent: usize,
    stdin: Option<ChildStdin>,
    status: Option<ExitStatus>,
    /// When `status` was first seen.
    exited_at: Option<Instant>,
}

impl Proc {
    fn command(args: &[String]) -> Result<Command> {
        let mut command = Command::new(bin_path("tq-fault")?);
        command.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        command.env(tensor_queue::SECRET_ENV, TCP_SECRET);
        Ok(command)
    }

    /// Starts `tq-fault <args>` (with [`TCP_SECRET`] in `TQ_SECRET`, for the TCP channels).
    fn start(name: &str, args: &[String]) -> Result<Proc> {
        let child = Proc::command(args)?.spawn().with_context(|| format!("starting tq-fault for {name}"))?;
        Ok(Proc::adopt(name, child))
    }

    /// Starts `tq-fault <args>` with a channel to it ([`tensor_queue::spawn`]).
    fn spawn<T: Serialize>(name: &str, args: &[String]) -> Result<(Proc, tensor_queue::Sender<T>)> {
        let (child, sender) = tensor_queue::spawn::<T>(&mut Proc::command(args)?)?;
        Ok((Proc::adopt(name, child), sender))
    }

    fn adopt(name: &str, mut child: Child) -> Proc {
        let lines = integration_tests::stdout_lines(&mut child, None);
        let stdin = child.stdin.take();
        let name = format!("{name} ({})", child.id());
        Proc { name, child, lines, said: Vec::new(), sent: 0, stdin, status: None, exited_at: None }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn absorb(&mut self, line: String) {
        if line.starts_with("sent ") {
            self.sent += 1;
        }
        self.said.push(line);
    }

    /// Takes in the lines said since the last call, without waiting.
    fn poll(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.absorb(line);
        }
    }

    /// Takes in every line up to the end of its output (it must have exited), for up to `timeout`.
    fn finish_lines(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while let Ok(line) = self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            self.absorb(line);
        }
    }

    fn lines_starting(&self, prefix: &str) -> impl Iterator<Item = &String> {
        self.said.iter().filter(move |line| line.starts_with(prefix))
    }

    fn has_said(&self, prefix: &str) -> bool {
        self.lines_starting(prefix).next().is_some()
    }

    /// The last `n` lines it said, for error messages.
    fn tail(&self, n: usize) -> String {
        let start = self.said.len().saturating_sub(n);
        format!("{} said {} lines, the last: {:#?}", self.name, self.said.len(), &self.said[start..])
    }

    /// Its exit status, if it has exited (without waiting).
    fn exited(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait()?;
            if self.status.is_some() {
                self.exited_at = Some(Instant::now());
            }
        }
        Ok(self.status)
    }

    /// Waits up to `timeout` for a line starting with `prefix` (said now or before).
    fn wait_said(&mut self, prefix: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll();
            if self.has_said(prefix) {
                return Ok(());
            }
            if let Some(status) = self.exited()? {
                self.finish_lines(Duration::from_secs(2));
                ensure!(
                    self.has_said(prefix),
                    "{} exited ({status}) without saying {prefix:?}; {}",
                    self.name,
                    self.tail(30)
                );
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "{} did not say {prefix:?} within {timeout:?}; {}",
                self.name,
                self.tail(30)
            );
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(5)) {
                self.absorb(line);
            }
        }
    }

    /// Waits up to `timeout` for it to exit, taking in its lines meanwhile; `None` if it still runs.
    fn exit_within(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll();
            if let Some(status) = self.exited()? {
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends SIGKILL now (without waiting for the process to go).
    fn sigkill(&mut self) -> Result<()> {
        if self.exited()?.is_none() {
            self.child.kill().with_context(|| format!("killing {}", self.name))?;
        }
        Ok(())
    }

    /// Closes its stdin (for the consumer: drain and end).
    fn close_stdin(&mut self) {
        self.stdin = None;
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.exited(), Ok(None)) {
            let _ = self.child.kill();
            if self.exit_within(Duration::from_secs(10)).ok().flatten().is_none() {
                eprintln!("{} was not reaped within 10 s of its SIGKILL", self.name);
            }
        }
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// Eight threads of one producer process, each with its own `Sender::connect` and its own stream,
/// feed one receiver (a data-loader process with worker threads): each of the 16,000 fresh
/// 256-byte tensors arrives exactly once, in order per sender, from the right process, with the
/// right bytes, and no CUDA error is left behind on either side.
fn eight_senders_in_one_process() -> Result<()> {
    const THREADS: u64 = 8;
    const COUNT: u64 = 2000;
    const LEN: usize = 256;
    const TAG: u64 = 1;
    let context = gpu()?;
    let path = socket_path("eight-senders");
    let mut receiver = Receiver::<FaultItem>::bind(&path)?;
    let path = path.to_str().context("a UTF-8 socket path")?;
    let mut producer = Proc::start(
        "producer",
        &strings(&["produce", "--to", path, "--threads", "8", "--count", "2000", "--len", "256", "--tag", "1"]),
    )?;
    let total = THREADS * COUNT;
    let mut next = [0u64; THREADS as usize];
    let mut received = 0;
    let start = Instant::now();
    while received < total {
        ensure!(
            start.elapsed() < Duration::from_secs(120),
            "only {received} of {total} messages within 120 s; {}",
            producer.tail(20)
        );
        producer.poll();
        let (item, info) = match receiver.recv_with_info(Some(Duration::from_secs(1))) {
            Ok(received) => received,
            Err(Error::Timeout) => continue,
            Err(error) => bail!("recv after {received} messages: {error:?}; {}", producer.tail(20)),
        };
        ensure!(
            info.sender_pid == producer.pid() && item.pid == info.sender_pid,
            "a message of pid {} came from pid {} (the producer is {})",
            item.pid,
            info.sender_pid,
            producer.pid()
        );
        let (tag, thread, index) = decode_seed(item.seed);
        ensure!(
            tag == TAG && thread < THREADS && thread == u64::from(item.thread) && index == item.index,
            "seed {:#x} does not match thread {} message {}",
            item.seed,
            item.thread,
            item.index
        );
        let next = &mut next[thread as usize];
        ensure!(index == *next, "thread {thread}: message {index} arrived when {} was due", *next);
        ensure!(
            info.seq == index + 1,
            "thread {thread}'s message {index} has seq {} on its connection (expected {}): the threads do not have \
             a connection each",
            info.seq,
            index + 1
        );
        *next += 1;
        let seen = bounded_checksum(&item.tensor).with_context(|| format!("thread {thread} message {index}"))?;
        ensure!(seen == expected(LEN, item.seed), "thread {thread} message {index}: wrong bytes ({seen:#x})");
        received += 1;
    }
    println!("{total} messages from {THREADS} senders checked in {:.2} s", start.elapsed().as_secs_f64());
    let status = producer.exit_within(Duration::from_secs(30))?;
    producer.finish_lines(Duration::from_secs(2));
    ensure!(status.is_some_and(|s| s.success()), "the producer ended with {status:?}; {}", producer.tail(20));
    ensure!(producer.sent as u64 == total, "the producer said `sent` {} times; {}", producer.sent, producer.tail(20));
    ensure!(producer.lines_starting("released ").count() == THREADS as usize, "leases: {}", producer.tail(20));
    ensure!(producer.has_said("cuda ok"), "{}", producer.tail(20));
    let bad: Vec<_> = producer
        .said
        .iter()
        .filter(|l| ["error", "timeout", "unreleased", "disconnected"].iter().any(|p| l.starts_with(p)))
        .collect();
    ensure!(bad.is_empty(), "the producer said {bad:#?}");
    match receiver.recv_timeout(Duration::from_secs(2)) {
        Err(Error::Disconnected | Error::Timeout) => {}
        Ok(item) => bail!("a message beyond the {total}: thread {} message {}", item.thread, item.index),
        Err(error) => bail!("after the last message: {error:?}"),
    }
    let errors = receiver.take_errors();
    ensure!(errors.is_empty(), "the receiver closed connections: {errors:#?}");
    cuda_ok(&context)
}

/// What became of the killed producer's message.
enum DoomedMessage {
    /// Not seen yet.
    Pending,
    /// `recv` said `Error::ProducerFailed` for it.
    Refused,
    /// `recv` delivered it; `flagged` is when `producer_failed()` was first seen true.
    Delivered { item: FaultItem, flagged: Option<Instant> },
}

/// A producer is SIGKILLed right after `send_on` while a 3 s kernel that writes its tensor is
/// still queued (a trainer crashing mid-step): its message is refused (`ProducerFailed`) or
/// flagged (`producer_failed()`), never delivered as complete; work on its tensor's stream does
/// not hang; a healthy producer's tensors keep arriving every 50 ms meanwhile, with the right
/// bytes, not held up by the dead producer's fence; and the receiver's context still works.
fn producer_killed_with_work_queued() -> Result<()> {
    const HEALTHY_LEN: usize = 64 << 10;
    const DOOMED_LEN: usize = MIB;
    const SPIN: Duration = Duration::from_secs(3);
    let context = gpu()?;
    let path = socket_path("killed-producer");
    let mut receiver = Receiver::<FaultItem>::bind(&path)?;
    let path = path.to_str().context("a UTF-8 socket path")?;
    let mut healthy = Proc::start(
        "healthy producer",
        &strings(&["produce", "--to", path, "--count", "1000", "--len", "65536", "--tag", "2", "--every-ms", "50"]),
    )?;
    let mut healthy_arrivals: Vec<Instant> = Vec::new();
    /// Checks a healthy message's bytes on the GPU and notes when it was usable.
    fn check_healthy(item: &FaultItem, arrivals: &mut Vec<Instant>) -> Result<()> {
        let seen = bounded_checksum(&item.tensor).with_context(|| format!("healthy message {}", item.index))?;
        ensure!(seen == expected(HEALTHY_LEN, item.seed), "healthy message {}: wrong bytes", item.index);
        arrivals.push(Instant::now());
        Ok(())
    }
    // The healthy producer's first message: its channel and GPU work flow before the other starts.
    let start = Instant::now();
    while healthy_arrivals.is_empty() {
        ensure!(start.elapsed() < Duration::from_secs(30), "no healthy message within 30 s; {}", healthy.tail(20));
        match receiver.recv_with_info(Some(Duration::from_millis(100))) {
            Ok((item, _)) => check_healthy(&item, &mut healthy_arrivals)?,
            Err(Error::Timeout) => healthy.poll(),
            Err(error) => bail!("recv: {error:?}; {}", healthy.tail(20)),
        }
    }
    let spin_us = SPIN.as_micros().to_string();
    let mut doomed = Proc::start(
        "doomed producer",
        &strings(&[
            "produce",
            "--to",
            path,
            "--count",
            "1",
            "--len",
            "1048576",
            "--tag",
            "3",
            "--spin-every",
            "1",
            "--spin-us",
            &spin_us,
        ]),
    )?;
    let spawned = Instant::now();
    let (mut sent_at, mut killed_at): (Option<Instant>, Option<Instant>) = (None, None);
    let mut doomed_message = DoomedMessage::Pending;
    loop {
        match killed_at {
            Some(killed) if killed.elapsed() > Duration::from_secs(5) => break,
            Some(_) => {}
            None => {
                ensure!(
                    spawned.elapsed() < Duration::from_secs(30),
                    "the doomed producer did not send within 30 s; {}",
                    doomed.tail(20)
                );
                doomed.poll();
                if doomed.has_said("sent 0 0") {
                    sent_at = Some(Instant::now());
                    doomed.sigkill()?;
                    killed_at = Some(Instant::now());
                }
            }
        }
        match receiver.recv_with_info(Some(Duration::from_millis(5))) {
            Ok((item, info)) if info.sender_pid == healthy.pid() => check_healthy(&item, &mut healthy_arrivals)?,
            Ok((item, info)) if info.sender_pid == doomed.pid() => {
                ensure!(matches!(doomed_message, DoomedMessage::Pending), "the doomed producer's message came twice");
                doomed_message = DoomedMessage::Delivered { item, flagged: None };
            }
            Ok((_, info)) => bail!("a message from pid {}, which is neither producer", info.sender_pid),
            Err(Error::ProducerFailed { pid, seq, .. }) => {
                ensure!(pid == doomed.pid() && seq == 1, "ProducerFailed for pid {pid} seq {seq}");
                ensure!(matches!(doomed_message, DoomedMessage::Pending), "the doomed message was reported twice");
                doomed_message = DoomedMessage::Refused;
            }
            Err(Error::Timeout) => {}
            Err(error) => bail!("recv: {error:?}"),
        }
        if let DoomedMessage::Delivered { item, flagged: flagged @ None } = &mut doomed_message
            && item.tensor.producer_failed()
        {
            *flagged = Some(Instant::now());
        }
        healthy.poll();
    }
    let watched_until = Instant::now();
    let (sent_at, killed_at) = (sent_at.context("sent")?, killed_at.context("killed")?);
    ensure!(
        killed_at - sent_at < SPIN / 3,
        "the kill came {:?} after the send: too late to land while the work was queued",
        killed_at - sent_at
    );
    let status = doomed.exit_within(Duration::from_secs(10))?;
    ensure!(status.and_then(|s| s.signal()) == Some(9), "the doomed producer ended with {status:?}");

    // The doomed message: refused, or delivered and flagged once its producer was dead.
    match doomed_message {
        DoomedMessage::Pending => {
            bail!("the killed producer's message was neither delivered nor reported within 5 s of the kill")
        }
        DoomedMessage::Refused => println!("the killed producer's message was refused by recv (ProducerFailed)"),
        DoomedMessage::Delivered { flagged: None, .. } => {
            bail!(
                "the killed producer's message was delivered as complete: producer_failed() was still false 5 s after the kill"
            )
        }
        DoomedMessage::Delivered { item, flagged: Some(flagged) } => {
            ensure!(flagged >= killed_at, "producer_failed() was true before the producer was killed");
            println!(
                "the killed producer's message was delivered and flagged {:?} after the kill",
                flagged - killed_at
            );
            // Work ordered after the dead producer's fence runs; it must not wait forever.
            let sum = within(USABLE_WITHIN, "a checksum on the killed producer's tensor's stream", move || {
                let sum = checksum(&item.tensor);
                drop(item);
                sum
            })?;
            let intact = sum == expected(DOOMED_LEN, fault_seed(3, 0, 0));
            println!("a checksum of its tensor finished; the bytes are the intended ones: {intact}");
        }
    }

    // The healthy producer's tensors kept coming while the dead one's work would have run.
    let during = |from: Instant, to: Instant| healthy_arrivals.iter().filter(|&&at| at >= from && at < to).count();
    let in_spin = during(killed_at, killed_at + SPIN);
    let after_kill = during(killed_at, killed_at + Duration::from_secs(5));
    let last_arrival = healthy_arrivals.last().copied().unwrap_or(sent_at);
    let worst_gap = healthy_arrivals
        .windows(2)
        .filter(|w| w[1] > sent_at)
        .map(|w| w[1] - w[0])
        .chain([watched_until.saturating_duration_since(last_arrival)])
        .max()
        .unwrap_or_default();
    println!(
        "healthy messages: {in_spin} in the 3 s after the kill, {after_kill} in 5 s, worst gap {} ms",
        worst_gap.as_millis()
    );
    ensure!(in_spin >= 20, "only {in_spin} healthy messages in the 3 s after the kill (one is sent every 50 ms)");
    ensure!(worst_gap < Duration::from_secs(1), "the healthy messages stalled for {worst_gap:?}");
    cuda_ok(&context)?;

    // The healthy producer finds the receiver gone, gets its leases back and ends cleanly.
    drop(receiver);
    let status = healthy.exit_within(Duration::from_secs(10))?;
    healthy.finish_lines(Duration::from_secs(2));
    ensure!(status.is_some_and(|s| s.success()), "the healthy producer ended with {status:?}; {}", healthy.tail(20));
    for prefix in ["disconnected 0", "released 0", "cuda ok"] {
        ensure!(healthy.has_said(prefix), "the healthy producer never said {prefix:?}; {}", healthy.tail(20));
    }
    ensure!(!healthy.has_said("error") && !healthy.has_said("timeout"), "{}", healthy.tail(20));
    Ok(())
}

/// Puts the idle release time back to its default when a test ends, pass or fail.
struct DefaultIdleRelease;

impl Drop for DefaultIdleRelease {
    fn drop(&mut self) {
        memory::set_idle_release(Duration::from_secs(1));
    }
}

/// A consumer holding 600 MiB of this process's GPU tensors is SIGKILLed (a crashed inference
/// worker): the leases come back, and once the tensors are dropped the memory goes back to the
/// driver, through `memory::trim` and through the idle release alike, so a long-lived producer
/// does not keep memory that dead peers held.
fn memory_goes_back_to_the_driver() -> Result<()> {
    const LEN: usize = 200 * MIB;
    const SLACK: usize = 64 * MIB;
    let _restore = DefaultIdleRelease;
    let context = gpu()?;
    let kernels = Kernels::get(&context)?;
    let stream = Stream::new(&context)?;
    let fill = |seed: u64| -> Result<Tensor> {
        let tensor = Tensor::empty_cuda(&context, DType::U8, &[LEN as u64])?;
        kernels.fill(&tensor.cuda_view()?, 0, LEN, seed, &stream)?;
        Ok(tensor)
    };
    // Warm up the allocator and the kernels, then give back whatever is idle.
    drop(Tensor::empty_cuda(&context, DType::U8, &[4096])?);
    stream.synchronize()?;
    memory::trim();
    let baseline = free_bytes(&context)?;
    let usage0 = memory::usage();
    println!(
        "baseline: {:.0} MiB free; this process's arenas hold {} bytes of device memory",
        mib(baseline as i64),
        usage0.device_bytes
    );

    let (mut holder, sender) = Proc::spawn::<FaultItem>("holder", &strings(&["hold"]))?;
    let tensors = (0..3).map(|k| fill(fault_seed(4, 0, k))).collect::<Result<Vec<_>>>()?;
    let held = memory::usage();
    ensure!(
        held.device_bytes >= usage0.device_bytes + 3 * LEN && held.in_use_bytes >= usage0.in_use_bytes + 3 * LEN,
        "usage() does not show the 3 x 200 MiB tensors: {held:?} (before: {usage0:?})"
    );
    for (k, tensor) in tensors.iter().enumerate() {
        let item = FaultItem {
            pid: std::process::id(),
            thread: 0,
            index: k as u64,
            seed: fault_seed(4, 0, k as u64),
            tensor: tensor.clone(),
        };
        sender.send_on_timeout(&item, &stream, Duration::from_secs(10))?;
    }
    holder.wait_said("holding 3", Duration::from_secs(60))?;
    ensure!(holder.lines_starting("holding ").all(|l| l.ends_with(" ok")), "{}", holder.tail(5));
    let low = free_bytes(&context)?;
    ensure!(
        baseline.saturating_sub(low) >= 3 * LEN - SLACK,
        "600 MiB of tensors took only {:.0} MiB off the driver's free memory: this test cannot see them",
        mib(baseline as i64 - low as i64)
    );
    ensure!(sender.outstanding_leases() == 3, "{} leases outstanding, not 3", sender.outstanding_leases());

    holder.sigkill()?;
    ensure!(holder.exit_within(Duration::from_secs(10))?.is_some(), "the holder was not gone 10 s after SIGKILL");
    let killed = Instant::now();
    ensure!(
        sender.wait_released(Duration::from_secs(10)),
        "{} leases still outstanding 10 s after the holder was killed",
        sender.outstanding_leases()
    );
    println!("leases back {} ms after the holder was reaped", killed.elapsed().as_millis());
    drop(sender);
    drop(tensors);
    let kept = memory::usage();
    let trimmed = memory::trim();
    let trimmed_usage = memory::usage();
    println!("after the drop: {kept:?}; trim() gave back {:.0} MiB; then {trimmed_usage:?}", mib(trimmed as i64));
    ensure!(
        trimmed_usage.device_bytes <= usage0.device_bytes && trimmed_usage.in_use_bytes <= usage0.in_use_bytes,
        "after trim the arenas still hold more than before: {trimmed_usage:?} (before: {usage0:?})"
    );
    let took = wait_for(Duration::from_secs(5), || free_bytes(&context).is_ok_and(|f| f + SLACK >= baseline))
        .with_context(|| {
            let free = free_bytes(&context).unwrap_or_default();
            format!("free memory is {:.0} MiB below the baseline 5 s after trim", mib(baseline as i64 - free as i64))
        })?;
    println!("trim: free memory back at the baseline after {} ms", took.as_millis());

    // The automatic path: no trim, the idle release gives the chunks back by itself.
    let tensors = (0..3).map(|k| fill(fault_seed(5, 0, k))).collect::<Result<Vec<_>>>()?;
    stream.synchronize()?;
    let low = free_bytes(&context)?;
    drop(tensors);
    memory::set_idle_release(Duration::from_millis(200));
    // Only the driver is asked while waiting, so nothing here can trigger the release.
    let took = wait_for(Duration::from_secs(2), || free_bytes(&context).is_ok_and(|f| f + SLACK >= baseline))
        .with_context(|| {
            let free = free_bytes(&context).unwrap_or_default();
            format!(
                "free memory is {:.0} MiB below the baseline 2 s after the drop (idle release 200 ms)",
                mib(baseline as i64 - free as i64)
            )
        })?;
    let released = memory::usage();
    println!(
        "idle release: {:.0} MiB came back {} ms after the drop (the default would take 1000 ms); {released:?}",
        mib(baseline as i64 - low as i64),
        took.as_millis()
    );
    ensure!(
        released.device_bytes <= usage0.device_bytes,
        "the arenas still hold {} bytes after the idle release (before: {})",
        released.device_bytes,
        usage0.device_bytes
    );
    Ok(())
}

/// Sends `SIG<name>` to `proc` (the `kill` command: no libc binding needed for a test).
fn signal(proc: &Proc, name: &str) -> Result<()> {
    let status = Command::new("kill").arg(format!("-{name}")).arg(proc.pid().to_string()).status()?;
    ensure!(status.success(), "kill -{name} {} failed: {status}", proc.pid());
    Ok(())
}

/// A small xorshift generator: each round's plan follows from its seed.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        XorShift(seed.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// When a round's victim is killed.
#[derive(Debug)]
enum KillAt {
    /// This long after the producers were started (possibly before they did anything).
    AfterMs(u64),
    /// Once the producers have sent this many messages together.
    AfterSent(usize),
    /// Once the producers have sent this many messages, with the consumer stopped (SIGSTOP)
    /// first, and the victim reaped before the consumer goes on: the victim's last messages are
    /// read only after it died.
    ConsumerStopped(usize),
}

/// The ways a round's tensors may come to the consumer (`tq-fault consume --landing`), and how
/// many GPUs each needs.
const SUITE_LANDINGS: &[(&str, usize)] =
    &[("same", 1), ("staged", 1), ("host", 1), ("peer-copy", 2), ("peer-map", 2), ("staged-across", 2)];

/// What one round of the fault suite does.
#[derive(Debug)]
struct RoundPlan {
    /// The round's seed (the suite's seed plus the round's number).
    seed: u64,
    /// How the tensors come to the consumer: a `--landing` of `tq-fault consume`.
    landing: &'static str,
    /// 0: the consumer; 1 or 2: that producer.
    victim: usize,
    kill: KillAt,
    /// Per producer: every how many messages a spin kernel runs before the fill, and for how
    /// many microseconds.
    spins: [(u64, u64); 2],
}

const SUITE_ROUNDS: u64 = 12;
const SUITE_PRODUCERS: usize = 2;
const SUITE_THREADS: u64 = 2;
const SUITE_PER_THREAD: u64 = 2500;
const SUITE_MESSAGES: u64 = SUITE_PRODUCERS as u64 * SUITE_THREADS * SUITE_PER_THREAD;
const SUITE_LEN: usize = 64 << 10;
/// How far below the baseline free device memory may be after a round.
const SUITE_MEMORY_SLACK: usize = 64 * MIB;
/// How many more descriptors than at the start this process may have after a round.
const SUITE_FD_SLACK: usize = 4;

impl RoundPlan {
    /// The plan of the round of seed `seed` on a machine with `gpus` GPUs.
    fn new(seed: u64, gpus: usize) -> RoundPlan {
        let mut rng = XorShift::new(seed);
        let victim = rng.below(3) as usize;
        let kill = match rng.below(6) {
            0 => KillAt::AfterMs(rng.below(300)),
            1 | 2 => KillAt::ConsumerStopped(rng.below(SUITE_MESSAGES) as usize),
            _ => KillAt::AfterSent(rng.below(SUITE_MESSAGES) as usize),
        };
        let spins = [(); 2].map(|()| (8 + rng.below(17), 100 + rng.below(1900)));
        let landings: Vec<&'static str> =
            SUITE_LANDINGS.iter().filter(|(_, needs)| *needs <= gpus).map(|(name, _)| *name).collect();
        let landing = landings[rng.below(landings.len() as u64) as usize];
        RoundPlan { seed, landing, victim, kill, spins }
    }
}

/// What a round counted.
#[derive(Default)]
struct RoundTally {
    ok: u64,
    lost: u64,
    /// From the kill until every process of the round had ended (survivors finish their work).
    recovery: Duration,
}

/// The tag of producer `k` of `round`, in its seeds.
fn suite_tag(round: u64, k: usize) -> u64 {
    16 + round * 4 + k as u64
}

/// Twelve rounds, each of a consumer process and two producer processes with two senders each
/// (threads with their own connections) streaming 10,000 fresh GPU tensors, some written after a
/// short spin kernel, with one of the three SIGKILLed at a random moment (a worker crash in a data
/// pipeline; sometimes with the consumer stopped until the killed producer is reaped, so that its
/// last messages are read after it died), the tensors coming each round by a random way (mapped,
/// staged, landed on the host; across GPUs where there are two). The plans follow from a seed,
/// printed first, that `TQ_FAULT_SEED` replays: no message is ever delivered as complete with wrong bytes, every message a live
/// consumer was sent is received or reported lost, nothing hangs, the survivors' CUDA contexts
/// stay healthy, and device memory and this process's file descriptors come back every round.
fn fault_suite() -> Result<()> {
    let context = gpu()?;
    let gpus = ipc_core::Device::count()? as usize;
    let seed = case_seed()?;
    memory::trim();
    let free0 = free_bytes(&context)?;
    let fds0 = open_fds()?;
    let start = Instant::now();
    let mut total = RoundTally::default();
    for round in 0..SUITE_ROUNDS {
        let plan = RoundPlan::new(seed.wrapping_add(round), gpus);
        let tally = fault_round(round, plan, &context, free0, fds0)
            .with_context(|| format!("round {round} (suite seed {seed})"))?;
        total.ok += tally.ok;
        total.lost += tally.lost;
        total.recovery = total.recovery.max(tally.recovery);
    }
    println!(
        "fault suite: {SUITE_ROUNDS} rounds in {:.1} s: {} messages ok, {} lost, worst recovery (kill to every \
         process ended) {} ms",
        start.elapsed().as_secs_f64(),
        total.ok,
        total.lost,
        total.recovery.as_millis()
    );
    Ok(())
}

fn fault_round(round: u64, plan: RoundPlan, context: &Arc<Context>, free0: usize, fds0: usize) -> Result<RoundTally> {
    let path = socket_path(&format!("fault-{round}"));
    let result = run_round(round, &plan, &path, context, free0, fds0);
    // A killed consumer leaves its socket file behind.
    let _ = std::fs::remove_file(&path);
    result.with_context(|| format!("plan {plan:?}"))
}

fn run_round(
    round: u64,
    plan: &RoundPlan,
    path: &std::path::Path,
    context: &Arc<Context>,
    free0: usize,
    fds0: usize,
) -> Result<RoundTally> {
    let path = path.to_str().context("a UTF-8 socket path")?;
    let len = SUITE_LEN.to_string();
    let mut consumer =
        Proc::start("consumer", &strings(&["consume", "--listen", path, "--len", &len, "--landing", plan.landing]))?;
    consumer.wait_said("ready", Duration::from_secs(30))?;
    let mut producers = (0..SUITE_PRODUCERS)
        .map(|k| {
            let (every, us) = plan.spins[k];
            let tag = suite_tag(round, k).to_string();
            let (threads, count) = (SUITE_THREADS.to_string(), SUITE_PER_THREAD.to_string());
            let (every, us) = (every.to_string(), us.to_string());
            Proc::start(
                &format!("producer {k}"),
                &strings(&[
                    "produce",
                    "--to",
                    path,
                    "--threads",
                    &threads,
                    "--count",
                    &count,
                    "--len",
                    &len,
                    "--tag",
                    &tag,
                    "--spin-every",
                    &every,
                    "--spin-us",
                    &us,
                ]),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let spawned = Instant::now();

    // The kill, once its moment has come (or everything already ended, or 30 s passed).
    loop {
        consumer.poll();
        producers.iter_mut().for_each(Proc::poll);
        let sent: usize = producers.iter().map(|p| p.sent).sum();
        let due = match plan.kill {
            KillAt::AfterMs(ms) => spawned.elapsed() >= Duration::from_millis(ms),
            KillAt::AfterSent(n) | KillAt::ConsumerStopped(n) => sent >= n,
        };
        let mut producers_running = false;
        for producer in &mut producers {
            producers_running |= producer.exited()?.is_none();
        }
        let consumer_running = consumer.exited()?.is_none();
        if due || !producers_running || !consumer_running || spawned.elapsed() > Duration::from_secs(30) {
            break;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    let sent_at_kill: usize = producers.iter().map(|p| p.sent).sum();
    let victim = if plan.victim == 0 { &mut consumer } else { &mut producers[plan.victim - 1] };
    let victim_name = victim.name.clone();
    let victim_pid = victim.pid();
    // A victim that already ended by itself is a survivor.
    let victim_was_running = victim.exited()?.is_none();
    let stopped = matches!(plan.kill, KillAt::ConsumerStopped(_)) && plan.victim != 0;
    if stopped {
        // The consumer reads nothing more until the victim is dead and reaped; the producers
        // send what their credits allow meanwhile.
        signal(&consumer, "STOP")?;
        std::thread::sleep(Duration::from_millis(200));
    }
    let victim = if plan.victim == 0 { &mut consumer } else { &mut producers[plan.victim - 1] };
    victim.sigkill()?;
    let killed_at = Instant::now();
    if stopped {
        let reaped = victim.exit_within(Duration::from_secs(10))?.is_some();
        signal(&consumer, "CONT")?;
        ensure!(reaped, "{victim_name} outlived its SIGKILL by 10 s");
    }
    let at = spawned.elapsed();

    // Every process ends within 10 s of the kill (the consumer within 10 s of being told).
    let mut problems: Vec<String> = Vec::new();
    for producer in &mut producers {
        if producer.exit_within(Duration::from_secs(10).saturating_sub(killed_at.elapsed()))?.is_none() {
            problems.push(format!("{} still ran 10 s after the kill", producer.name));
        }
    }
    consumer.close_stdin();
    if consumer.exit_within(Duration::from_secs(10))?.is_none() {
        problems.push(format!("{} still ran 10 s after it was told to finish", consumer.name));
    }
    let last_exit = [&consumer].into_iter().chain(&producers).filter_map(|p| p.exited_at).max();
    let recovery = last_exit.unwrap_or(killed_at).saturating_duration_since(killed_at);
    for proc in [&mut consumer].into_iter().chain(&mut producers) {
        proc.sigkill()?;
        proc.exit_within(Duration::from_secs(10))?;
        proc.finish_lines(Duration::from_secs(2));
    }

    // Exit statuses, and a healthy context in every survivor.
    let killed = |proc: &Proc| victim_was_running && proc.pid() == victim_pid;
    for proc in [&consumer].into_iter().chain(&producers) {
        let status = proc.status.context("reaped")?;
        if killed(proc) {
            if status.signal() != Some(9) {
                problems.push(format!("{} was SIGKILLed but ended with {status}", proc.name));
            }
        } else {
            if !status.success() {
                problems.push(format!("{} ended with {status}", proc.name));
            }
            if !proc.has_said("cuda ok") {
                problems.push(format!("{} did not end with `cuda ok`", proc.name));
            }
        }
        for prefix in ["error", "failed", "timeout", "unreleased", "cuda error"] {
            for line in proc.lines_starting(prefix).take(5) {
                problems.push(format!("{}: {line}", proc.name));
            }
        }
    }

    // Every `ok` is a message of this round, from the producer that sent it, once.
    let producer_of: HashMap<u32, usize> = producers.iter().enumerate().map(|(k, p)| (p.pid(), k)).collect();
    let dead_producer = (plan.victim > 0 && victim_was_running).then_some(victim_pid);
    let mut ok: HashSet<(u32, u64)> = HashSet::new();
    let mut refused: HashMap<(u32, u64), usize> = HashMap::new();
    let mut flagged: HashSet<(u32, u64)> = HashSet::new();
    let mut conn_errors = 0;
    for line in &consumer.said {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
        match fields.as_slice() {
            ["ok", ..] => {
                let (Some(pid), Some(seed), Some(seq)) = (number(1), number(2), number(3)) else {
                    problems.push(format!("consumer: unreadable {line:?}"));
                    continue;
                };
                let pid = pid as u32;
                let (tag, thread, index) = decode_seed(seed);
                let right_tag = producer_of.get(&pid).is_some_and(|&k| suite_tag(round, k) == tag);
                if !right_tag || thread >= SUITE_THREADS || index >= SUITE_PER_THREAD || seq != index + 1 {
                    problems.push(format!("consumer: {line:?} is not a message of this round's producer {pid}"));
                }
                if !ok.insert((pid, seed)) {
                    problems.push(format!("consumer: {line:?} twice"));
                }
            }
            ["lost", "producer-failed", ..] | ["lost", "flag", ..] => {
                let (Some(pid), Some(value)) = (number(2), number(3)) else {
                    problems.push(format!("consumer: unreadable {line:?}"));
                    continue;
                };
                let pid = pid as u32;
                if dead_producer != Some(pid) {
                    problems.push(format!("consumer: {line:?}, but pid {pid} was not killed"));
                } else if fields[1] == "flag" {
                    flagged.insert((pid, value));
                } else {
                    *refused.entry((pid, value)).or_default() += 1;
                }
            }
            ["conn-error", ..] => conn_errors += 1,
            ["ready"] | ["cuda", "ok"] | ["done", ..] => {}
            _ if fields.first().is_some_and(|f| ["error", "failed", "cuda"].contains(f)) => {} // counted above
            _ => problems.push(format!("consumer: unexpected {line:?}")),
        }
    }
    let lost = (refused.values().sum::<usize>() + flagged.len()) as u64;

    // With the consumer alive, every message a producer said it sent is accounted for.
    let consumer_lived = plan.victim != 0 || !victim_was_running;
    let mut unaccounted = Vec::new();
    if consumer_lived {
        for (k, producer) in producers.iter().enumerate() {
            let pid = producer.pid();
            for line in producer.lines_starting("sent ") {
                let fields: Vec<u64> = line.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
                let [thread, index] = fields[..] else {
                    problems.push(format!("{}: unreadable {line:?}", producer.name));
                    continue;
                };
                let seed = fault_seed(suite_tag(round, k), thread, index);
                if ok.contains(&(pid, seed)) || flagged.contains(&(pid, seed)) {
                    continue;
                }
                match refused.get_mut(&(pid, index + 1)) {
                    Some(n) if *n > 0 && dead_producer == Some(pid) => *n -= 1,
                    _ => unaccounted.push(format!("{} thread {thread} message {index}", producer.name)),
                }
            }
            if dead_producer != Some(pid) {
                let complete = producer.sent as u64 == SUITE_THREADS * SUITE_PER_THREAD;
                let released = producer.lines_starting("released ").count() as u64 == SUITE_THREADS;
                if !complete || !released {
                    problems.push(format!(
                        "{} survived beside a live consumer but sent {} of {} (released on every thread: {released})",
                        producer.name,
                        producer.sent,
                        SUITE_THREADS * SUITE_PER_THREAD
                    ));
                }
            }
        }
    } else {
        // The consumer died: the producers were told (Disconnected) and got their leases back.
        for producer in &producers {
            let released = producer.lines_starting("released ").count() as u64;
            if released != SUITE_THREADS {
                problems.push(format!("{}: leases of only {released} threads came back", producer.name));
            }
        }
    }
    if !unaccounted.is_empty() {
        problems.push(format!(
            "{} sent messages were neither received nor reported lost, e.g. {:?}",
            unaccounted.len(),
            &unaccounted[..unaccounted.len().min(5)]
        ));
    }

    let sent: usize = producers.iter().map(|p| p.sent).sum();
    let tails = if problems.is_empty() {
        String::new()
    } else {
        [&consumer].into_iter().chain(&producers).map(|p| p.tail(15)).collect::<Vec<_>>().join("\n")
    };

    // Nothing is left behind: device memory and this process's descriptors.
    drop(consumer);
    drop(producers);
    let memory_back =
        wait_for(Duration::from_secs(10), || free_bytes(context).is_ok_and(|f| f + SUITE_MEMORY_SLACK >= free0));
    let free = free_bytes(context)?;
    if memory_back.is_none() {
        problems.push(format!(
            "free device memory is {:.0} MiB below the baseline 10 s after the round",
            mib(free0 as i64 - free as i64)
        ));
    }
    let fds_back = wait_for(Duration::from_secs(2), || open_fds().is_ok_and(|n| n <= fds0 + SUITE_FD_SLACK));
    let fds = open_fds()?;
    if fds_back.is_none() {
        problems.push(format!("this process has {fds} descriptors open, {fds0} at the start"));
    }

    let killed_what = match plan.kill {
        _ if !victim_was_running => "after it had ended".to_string(),
        KillAt::AfterMs(_) => format!("{} ms after the start", at.as_millis()),
        KillAt::AfterSent(_) => format!("after {sent_at_kill} sends ({} ms)", at.as_millis()),
        KillAt::ConsumerStopped(_) if stopped => {
            format!("after {sent_at_kill} sends ({} ms), the consumer stopped until it was reaped", at.as_millis())
        }
        KillAt::ConsumerStopped(_) => format!("after {sent_at_kill} sends ({} ms)", at.as_millis()),
    };
    println!(
        "round {round:2} (seed {}, landing {}): killed {victim_name} {killed_what}; {sent} of {SUITE_MESSAGES} said sent, {} ok, {lost} \
         lost, {conn_errors} connection errors; every process ended {} ms after the kill; free memory {:+.0} MiB from the start, back in {} ms; \
         {fds} fds ({fds0} at the start)",
        plan.seed,
        plan.landing,
        ok.len(),
        recovery.as_millis(),
        mib(free as i64 - free0 as i64),
        memory_back.unwrap_or_default().as_millis(),
    );
    ensure!(problems.is_empty(), "round {round}:\n  {}\n{tails}", problems.join("\n  "));
    Ok(RoundTally { ok: ok.len() as u64, lost, recovery })
}

// ------------------------------------------------- a producer killed on each route, at each moment

/// How a killed producer's tensors reach the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// Mapped in place on the producer's GPU.
    SameGpu,
    /// Staged through pinned host memory, back onto the same GPU.
    Staged,
    /// Landed in host memory (`Landing::Host`).
    Host,
    /// Copied by the producer over the peer link onto the receiver's GPU 1.
    PeerCopy,
    /// Mapped over the peer link for GPU 1.
    PeerMap,
    /// Staged through pinned host memory onto GPU 1.
    StagedAcross,
    /// Over a TCP channel (`tcp://127.0.0.1`, the secret in `TQ_SECRET`), landed in host memory:
    /// the producer copies to the host and writes the bytes on the link.
    Tcp,
    /// Over a TCP channel onto GPU 1: the tensors move through NCCL (the producer counts as on
    /// another host).
    Nccl,
}

impl Way {
    /// The receiver's routing for this way; `other` is GPU 1's UUID (for the cross-device ways).
    fn routing(self, other: Option<tensor_queue::Uuid>) -> Result<Routing> {
        let on_other = || other.map(|u| Routing::default().land(Landing::Device(u))).context("needs GPU 1");
        Ok(match self {
            Way::SameGpu => Routing::default(),
            Way::Staged => Routing::default().peer(PeerMode::Stage),
            Way::Host => Routing::default().land(Landing::Host),
            Way::PeerCopy => on_other()?.peer(PeerMode::Copy),
            Way::PeerMap => on_other()?.peer(PeerMode::Map),
            Way::StagedAcross => on_other()?.peer(PeerMode::Stage),
            Way::Tcp => Routing::default().land(Landing::Host),
            Way::Nccl => on_other()?,
        })
    }

    /// The paths a received tensor of this way says it came by.
    fn paths(self) -> &'static [TransferPath] {
        match self {
            Way::SameGpu => &[TransferPath::CudaVmm, TransferPath::CudaLegacyIpc],
            Way::Staged | Way::StagedAcross => &[TransferPath::Staged],
            Way::Host => &[TransferPath::StagedToHost],
            Way::PeerCopy => &[TransferPath::PeerCopied],
            Way::PeerMap => &[TransferPath::PeerMapped],
            Way::Tcp => &[TransferPath::Tcp],
            Way::Nccl => &[TransferPath::Nccl],
        }
    }

    /// Whether the channel is a TCP one (its sender counts as on another host).
    fn over_tcp(self) -> bool {
        matches!(self, Way::Tcp | Way::Nccl)
    }
}

/// When the producer is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Moment {
    /// After `send_on` returned with 2 s of GPU work queued (1 s over NCCL; none over TCP to the
    /// host, where `send_on` waits for it), and reaped, before the receiver's first `recv` (it
    /// had read nothing of the producer, not even its hello).
    BeforeRecv,
    /// After `send_on` returned with 2 s of GPU work queued (1 s over NCCL), while the receiver
    /// is receiving. Over TCP to the host, 500 ms into the 1 s of work `send_on` waits for.
    DuringWork,
    /// 3 ms after `send_on` returned with no work before its 1 GiB of copies (4 x 256 MiB):
    /// while they run, on the copy routes (it SIGKILLs itself: `tq-fault batch --die-after-us`).
    /// Over TCP to the host, 20 ms into `send_on`'s copies to the host (`--die-in-send-us`).
    DuringCopy,
    /// On a TCP channel, in the middle of writing a 256 MiB message (4 x 64 MiB) that the
    /// receiver does not read: once the producer uses no more CPU (its link waits for room in
    /// the socket), it is SIGKILLed. The message cannot arrive; it must be reported lost.
    MidFrame,
}

/// What one killed-producer case saw.
enum Outcome {
    /// `recv` said `Error::ProducerFailed`.
    Refused,
    /// Delivered, every byte the producer's (the driver ran its queued work to the end).
    Whole,
    /// Delivered with `producer_failed()` true.
    Flagged,
    /// Not delivered, and `take_errors()` has an entry for it (a TCP channel's message that the
    /// producer died in the middle of writing).
    Lost,
    /// Never sent: the producer died inside `send_on` (over TCP to the host it waits for the GPU
    /// work and copies before it returns), and the receiver saw nothing of the message.
    Unsent,
}

/// The secret of the killed-producer cases' TCP channels.
const TCP_SECRET: &str = "the fault suite's TCP secret, 0123456789";

/// Waits until process `pid` uses no CPU for 300 ms (all its threads wait), for up to `timeout`.
fn wait_blocked(pid: u32, timeout: Duration) -> Result<()> {
    let ticks = || -> Result<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // The fields after the command name, which is in parentheses and may hold spaces.
        let fields: Vec<&str> = stat.rsplit_once(')').context("a /proc stat line")?.1.split_whitespace().collect();
        let field = |i: usize| -> Result<u64> { Ok(fields.get(i).context("a short /proc stat line")?.parse::<u64>()?) };
        Ok(field(11)? + field(12)?) // utime and stime, fields 14 and 15 of the line
    };
    let start = Instant::now();
    let (mut last, mut still_since) = (ticks()?, Instant::now());
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = ticks()?;
        if now != last {
            (last, still_since) = (now, Instant::now());
        } else if still_since.elapsed() >= Duration::from_millis(300) {
            return Ok(());
        }
        ensure!(start.elapsed() < timeout, "pid {pid} kept using CPU for {timeout:?}");
    }
}

/// GPU time queued before the doomed producer's first fill, for the work moments.
const DOOMED_SPIN: Duration = Duration::from_secs(2);

/// Kills a `tq-fault batch` producer at `moment` on `way`, then checks as a user would: its
/// message is refused (`ProducerFailed`) or delivered flagged (`producer_failed()`), or delivered
/// whole with the producer's bytes (checked on the GPU); every received tensor's stream drains;
/// `recv` then says `Disconnected` (nothing of it stays parked); a message neither delivered nor
/// refused left an entry in `take_errors()`; a new producer's message arrives intact; and the
/// receiver's contexts still work.
fn killed_case(way: Way, moment: Moment, contexts: &[Arc<Context>], seed: u64) -> Result<Outcome> {
    let other = match contexts.get(1) {
        Some(context) => Some(context.device().uuid()?),
        None => None,
    };
    let builder = Receiver::<FaultBatch>::builder().routing(way.routing(other)?);
    let (mut receiver, path) = if way.over_tcp() {
        let receiver =
            builder.secret(tensor_queue::Secret::from_bytes(TCP_SECRET.as_bytes())?).bind("tcp://127.0.0.1:0")?;
        let endpoint = format!("tcp://{}", receiver.local_addr().context("a TCP receiver's address")?);
        (receiver, endpoint)
    } else {
        let path = socket_path(&format!("killed-{way:?}-{moment:?}"));
        let receiver = builder.bind(&path)?;
        (receiver, path.to_str().context("a UTF-8 socket path")?.to_string())
    };
    let (tensors, len, spin) = match moment {
        Moment::DuringCopy => (4, 256 * MIB, Duration::ZERO),
        Moment::MidFrame => (4, 64 * MIB, Duration::ZERO),
        // Over TCP to the host `send_on` waits for the work itself: none is needed before it
        // returns, and less is enough to die inside it.
        Moment::BeforeRecv if way == Way::Tcp => (4, 32 * MIB, Duration::ZERO),
        _ if way.over_tcp() => (4, 32 * MIB, DOOMED_SPIN / 2),
        _ => (4, 32 * MIB, DOOMED_SPIN),
    };
    // Over TCP to the host, `send_on` itself waits for the work and copies: the producer kills
    // itself inside it (500 ms into its 1 s of GPU work; 20 ms into copying 1 GiB to the host).
    let in_send = way == Way::Tcp && matches!(moment, Moment::DuringWork | Moment::DuringCopy);
    let batch_args = |seed: u64, tensors: usize, len: usize, spin: Duration| {
        let doomed = tensors > 2;
        let die_after_us = if doomed && !in_send && moment == Moment::DuringCopy { 3000 } else { 0 };
        let die_in_send_us = match moment {
            Moment::DuringWork if doomed && in_send => 500_000,
            Moment::DuringCopy if doomed && in_send => 20_000,
            _ => 0,
        };
        BatchArgs { spin, die_after_us, die_in_send_us, ..BatchArgs::new(&path, tensors, len, seed) }.to_args()
    };
    let mut doomed = Proc::start("doomed producer", &batch_args(seed, tensors, len, spin))?;
    let mut held: Vec<FaultBatch> = Vec::new();
    let mut refused = 0;
    // Up to the kill: the receiver receives meanwhile, except before its first `recv`.
    let started = Instant::now();
    loop {
        doomed.poll();
        // During its copies it kills itself, 3 ms after `send_on` returned: too soon to be hit
        // from here (it has printed `sent` first).
        // Asked once per turn: a process that ends between two questions (it kills itself) must
        // not be taken for one that ended before it sent.
        let exited = doomed.exited()?.is_some();
        let due = match moment {
            _ if in_send => exited,
            Moment::DuringCopy => exited,
            Moment::MidFrame => {
                // Its copies done, its link stuck writing to a receiver that does not read.
                doomed.has_said("sent") && {
                    wait_blocked(doomed.pid(), Duration::from_secs(30))?;
                    true
                }
            }
            _ => doomed.has_said("sent"),
        };
        if due {
            // Up to its end of output once it has exited (the lines still in the pipe).
            doomed.finish_lines(Duration::from_millis(if exited { 5000 } else { 100 }));
            ensure!(
                in_send || doomed.has_said("sent"),
                "the doomed producer ended before it sent; {}",
                doomed.tail(10)
            );
            ensure!(
                !in_send || (doomed.has_said("sending") && !doomed.has_said("sent")),
                "the doomed producer was to die inside send_on; {}",
                doomed.tail(10)
            );
            break;
        }
        ensure!(!exited, "the doomed producer ended before it sent; {}", doomed.tail(10));
        ensure!(started.elapsed() < Duration::from_secs(60), "no send within 60 s; {}", doomed.tail(10));
        if matches!(moment, Moment::BeforeRecv | Moment::MidFrame) {
            std::thread::sleep(Duration::from_micros(200));
        } else {
            take_doomed(&mut receiver, doomed.pid(), &mut held, &mut refused, Duration::from_micros(200))?;
        }
    }
    doomed.sigkill()?;
    let killed_at = Instant::now();
    if moment == Moment::BeforeRecv {
        // Reaped: its pid names nothing any more when the receiver first looks.
        ensure!(doomed.exit_within(Duration::from_secs(30))?.is_some(), "the doomed producer outlived its SIGKILL");
    }
    // Its message, then the end of its connection.
    let disconnected = loop {
        ensure!(
            killed_at.elapsed() < Duration::from_secs(30),
            "30 s after the kill, no Disconnected; its message was {}",
            if held.len() + refused == 0 { "neither delivered nor reported" } else { "handled" }
        );
        if take_doomed(&mut receiver, doomed.pid(), &mut held, &mut refused, Duration::from_millis(100))? {
            break killed_at.elapsed();
        }
    };
    let status = doomed.exit_within(Duration::from_secs(10))?;
    ensure!(status.and_then(|s| s.signal()) == Some(9), "the doomed producer ended with {status:?}");
    let errors = receiver.take_errors();
    // Over TCP a message the producer died in the middle of writing is lost, and reported.
    let lost = way.over_tcp() && held.is_empty() && refused == 0 && !errors.is_empty();
    let unsent = in_send && held.is_empty() && refused == 0;
    ensure!(
        held.len() + refused == 1 || lost || unsent,
        "the killed producer's one message was delivered {} times and refused {refused} times; errors: {errors:?}",
        held.len()
    );
    let outcome = match held.first() {
        Some(batch) => judge(batch, way, len)?,
        None if lost => Outcome::Lost,
        None if unsent => Outcome::Unsent,
        None => Outcome::Refused,
    };
    if moment == Moment::MidFrame {
        ensure!(matches!(outcome, Outcome::Lost), "a 256 MiB message the receiver never read was delivered");
    }
    println!(
        "  {way:?} killed {moment:?}: {}; Disconnected {} ms after the kill; errors: {errors:?}",
        match outcome {
            Outcome::Refused => "refused (ProducerFailed)",
            Outcome::Whole => "delivered whole (the driver finished its work)",
            Outcome::Flagged => "delivered, producer_failed()",
            Outcome::Lost => "lost, reported in take_errors()",
            Outcome::Unsent => "never sent (killed inside send_on), nothing received",
        },
        disconnected.as_millis()
    );
    drop(held);

    // A new producer on the same receiver: its message arrives intact.
    let healthy_seed = seed ^ 0x5a5a;
    let mut healthy = Proc::start("healthy producer", &batch_args(healthy_seed, 2, MIB, Duration::ZERO))?;
    let start = Instant::now();
    let batch = loop {
        ensure!(start.elapsed() < Duration::from_secs(30), "no healthy message within 30 s; {}", healthy.tail(10));
        match receiver.recv_timeout(Duration::from_millis(100)) {
            Ok(batch) => break batch,
            Err(Error::Timeout) => healthy.poll(),
            Err(Error::Disconnected) => {
                // Not connected yet: a bound receiver takes new senders after its last one left.
                healthy.poll();
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(error) => bail!("recv of the healthy message: {error:?}; {}", healthy.tail(10)),
        }
    };
    ensure!(batch.seed == healthy_seed && batch.tensors.len() == 2, "the healthy message is another's");
    for (k, tensor) in batch.tensors.iter().enumerate() {
        ensure!(way.paths().contains(&tensor.path()), "the healthy tensor came by {:?}", tensor.path());
        let seen = drained_checksum(tensor)?;
        ensure!(seen == expected(MIB, healthy_seed + k as u64), "healthy tensor {k}: wrong bytes");
        ensure!(!tensor.producer_failed(), "the healthy producer's tensor is flagged");
    }
    drop(batch);
    let status = healthy.exit_within(Duration::from_secs(30))?;
    healthy.finish_lines(Duration::from_secs(2));
    ensure!(status.is_some_and(|s| s.success()), "the healthy producer ended with {status:?}; {}", healthy.tail(10));
    ensure!(healthy.has_said("released") && healthy.has_said("cuda ok"), "{}", healthy.tail(10));
    for context in contexts {
        cuda_ok(context)?;
    }
    Ok(outcome)
}

/// What a delivered message of a killed producer is: whole (every byte its producer's, checked
/// on the GPU) or flagged; an error if a tensor's stream never drains or wrong bytes go unflagged.
fn judge(batch: &FaultBatch, way: Way, len: usize) -> Result<Outcome> {
    let mut intact = true;
    for (k, tensor) in batch.tensors.iter().enumerate() {
        ensure!(way.paths().contains(&tensor.path()), "tensor {k} came by {:?}", tensor.path());
        let seen = drained_checksum(tensor).with_context(|| format!("the killed producer's tensor {k}"))?;
        intact &= seen == expected(len, batch.seed + k as u64);
    }
    let settle = if intact { Duration::ZERO } else { Duration::from_secs(2) };
    let flagged = batch.tensors.iter().all(|t| wait_for(settle, || t.producer_failed()).is_some());
    Ok(match (intact, flagged) {
        (_, true) => Outcome::Flagged,
        (true, false) => Outcome::Whole,
        (false, false) => bail!("a killed producer's message was delivered with wrong bytes, not flagged"),
    })
}

/// A received tensor's checksum (on the GPU for GPU tensors), once its stream drained: an error
/// if it did not within [`USABLE_WITHIN`].
fn drained_checksum(tensor: &Tensor) -> Result<u64> {
    if tensor.stream().is_none() {
        return checksum(tensor); // in host memory
    }
    bounded_checksum(tensor)
}

/// Runs `cases`, each with its own seed from [`case_seed`]: all of them, then every failure.
/// `TQ_FAULT_CASES` (for example `SameGpu/BeforeRecv,Host/DuringCopy`) runs only those named.
fn killed_cases(cases: &[(Way, Moment)], contexts: &[Arc<Context>]) -> Result<()> {
    let seed = case_seed()?;
    let only = std::env::var("TQ_FAULT_CASES").ok();
    let mut failures = Vec::new();
    for (n, &(way, moment)) in cases.iter().enumerate() {
        if only.as_ref().is_some_and(|only| !only.split(',').any(|c| c == format!("{way:?}/{moment:?}"))) {
            continue;
        }
        let case_seed = (seed << 8) + n as u64 * 16;
        if let Err(error) = killed_case(way, moment, contexts, case_seed) {
            println!("  {way:?} killed {moment:?}: FAILED: {error:#}");
            failures.push(format!("{way:?} killed {moment:?}: {error:#}"));
        }
    }
    ensure!(
        failures.is_empty(),
        "{} of {} cases failed (seed {seed}):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    Ok(())
}

/// A producer SIGKILLed with its message sent, on each route of one GPU (mapped, staged, landed
/// on the host, over TCP to the host) and at each moment (before the receiver's first `recv`,
/// during its GPU work, during its copies, in the middle of writing a frame over TCP): see
/// [`killed_case`]. (Host tensors over TCP: `faults_host.rs`, in CI.)
fn killed_on_one_gpu() -> Result<()> {
    let context = gpu()?;
    killed_cases(
        &[
            (Way::SameGpu, Moment::BeforeRecv),
            (Way::SameGpu, Moment::DuringWork),
            (Way::Host, Moment::BeforeRecv),
            (Way::Host, Moment::DuringWork),
            (Way::Host, Moment::DuringCopy),
            (Way::Staged, Moment::BeforeRecv),
            (Way::Staged, Moment::DuringWork),
            (Way::Staged, Moment::DuringCopy),
            (Way::Tcp, Moment::BeforeRecv),
            (Way::Tcp, Moment::DuringWork),
            (Way::Tcp, Moment::DuringCopy),
            (Way::Tcp, Moment::MidFrame),
        ],
        &[context],
    )
}

/// The same across two GPUs: the peer copy, the peer mapping, staging onto GPU 1, and NCCL over
/// a TCP channel onto GPU 1.
fn killed_across_gpus() -> Result<()> {
    let contexts = vec![gpu()?, Context::on_ordinal(1)?];
    Kernels::get(&contexts[1])?;
    killed_cases(
        &[
            (Way::PeerCopy, Moment::BeforeRecv),
            (Way::PeerCopy, Moment::DuringWork),
            (Way::PeerCopy, Moment::DuringCopy),
            (Way::PeerMap, Moment::BeforeRecv),
            (Way::PeerMap, Moment::DuringWork),
            (Way::StagedAcross, Moment::BeforeRecv),
            (Way::StagedAcross, Moment::DuringCopy),
            (Way::Nccl, Moment::BeforeRecv),
            (Way::Nccl, Moment::DuringWork),
            (Way::Nccl, Moment::DuringCopy),
        ],
        &contexts,
    )
}

/// A message of 4 x 256 MiB landed in host memory (`Landing::Host`) from a healthy producer:
/// when `recv` returns, every byte of every tensor is there, the last ones of the last tensor
/// included (looked at first, at once); the sender copies in 4 MiB pieces, and a receiver that
/// took the first piece for the whole handed out tensors still being written.
fn host_landing_delivers_whole_tensors() -> Result<()> {
    const LEN: usize = 256 * MIB;
    const TAIL: usize = 4096;
    let context = gpu()?;
    let seed = case_seed()?;
    let path = socket_path("host-whole");
    let mut receiver = Receiver::<FaultBatch>::builder().routing(Routing::default().land(Landing::Host)).bind(&path)?;
    let path = path.to_str().context("a UTF-8 socket path")?;
    let mut producer = Proc::start("producer", &BatchArgs::new(path, 4, LEN, seed).to_args())?;
    let batch = match receiver.recv_timeout(Duration::from_secs(60)) {
        Ok(batch) => batch,
        Err(error) => bail!("recv: {error:?}; {}", producer.tail(10)),
    };
    // At once, newest bytes first: the tail of each tensor, from the last tensor back.
    let mut tails = Vec::new();
    for (k, tensor) in batch.tensors.iter().enumerate().rev() {
        // SAFETY: a host-landed tensor is this receiver's own memory (no clone, no view, never
        // sent on), and nothing writes it while `bytes` lives.
        let bytes = unsafe { tensor.host_elements::<u8>()?.as_slice() };
        tails.push((
            k,
            bytes[LEN - TAIL..] == reference::pattern(TAIL, batch.seed + k as u64 + (LEN - TAIL) as u64 / 8)[..],
        ));
    }
    for (k, whole) in tails {
        ensure!(whole, "tensor {k}'s last {TAIL} bytes were not written yet when recv returned it");
    }
    for (k, tensor) in batch.tensors.iter().enumerate() {
        ensure!(tensor.path() == TransferPath::StagedToHost, "tensor {k} came by {:?}", tensor.path());
        ensure!(checksum(tensor)? == expected(LEN, batch.seed + k as u64), "tensor {k}: wrong bytes");
        ensure!(!tensor.producer_failed(), "tensor {k} of a healthy producer is flagged");
    }
    drop(batch);
    let status = producer.exit_within(Duration::from_secs(30))?;
    producer.finish_lines(Duration::from_secs(2));
    ensure!(status.is_some_and(|s| s.success()), "the producer ended with {status:?}; {}", producer.tail(10));
    ensure!(producer.has_said("released") && producer.has_said("cuda ok"), "{}", producer.tail(10));
    cuda_ok(&context)
}
