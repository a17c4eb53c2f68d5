//! Section `host-msgs` (issue 26's row "1,000,000 small host messages, one host (no GPU)"): this
//! process sends `--messages N` small messages as fast as it can to a receiver process (this
//! binary again, with [`RECEIVER_FLAG`]) over a channel from [`tensor_queue::spawn`], in two
//! kinds: a `u64` alone, and a `u64` with a 16-byte host tensor (the same tensor each time, so
//! the figure is the channel's and not the allocator's). The rate is messages over the time from
//! the first send to the receiver's last receive (both `CLOCK_MONOTONIC`); both processes also
//! report their CPU time per message (user and system), which says where the time goes. Needs
//! no GPU.

use std::io::Read as _;
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, ensure};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tensor_queue::{DType, Error, Tensor, from_parent, monotonic_ns, spawn};

use super::{Bench, Row};

/// The first argument of a receiver process of this section.
pub const RECEIVER_FLAG: &str = "--host-msgs-receiver";

/// Issue 26's target (the rate measured a turn before the drop, on the same kind of machine).
const TARGET_PER_S: f64 = 155_000.0;

/// One small message.
#[derive(Serialize, Deserialize)]
struct HostMsg {
    seq: u64,
    tensor: Option<Tensor>,
}

/// What the receiver prints last.
#[derive(Serialize, Deserialize)]
struct ReceiverReport {
    count: u64,
    first_ns: u64,
    last_ns: u64,
    user_us: f64,
    system_us: f64,
}

/// This process's user and system CPU time in microseconds.
fn cpu_us() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) in parentheses; utime and stime are
    // the 14th and 15th fields, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<f64> = rest.split_whitespace().map(|f| f.parse().unwrap_or(0.0)).collect();
    let tick_us = 10_000.0;
    (fields.get(11).copied().unwrap_or(0.0) * tick_us, fields.get(12).copied().unwrap_or(0.0) * tick_us)
}

/// The receiver process: takes messages until the sender hangs up, checks their order, prints a
/// [`ReceiverReport`].
pub fn receiver() -> Result<()> {
    let mut messages = from_parent::<HostMsg>()?;
    let mut count = 0u64;
    let mut first_ns = 0;
    let mut last_ns = 0;
    loop {
        let msg = match messages.recv() {
            Ok(msg) => msg,
            Err(Error::Disconnected) => break,
            Err(error) => return Err(error.into()),
        };
        last_ns = monotonic_ns();
        if count == 0 {
            first_ns = last_ns;
        }
        ensure!(msg.seq == count, "message {} arrived as number {count}", msg.seq);
        if let Some(tensor) = &msg.tensor {
            ensure!(tensor.get::<u8>(&[0])? == 7, "the tiny tensor arrived with other contents");
        }
        count += 1;
    }
    let (user_us, system_us) = cpu_us();
    println!("{}", serde_json::to_string(&ReceiverReport { count, first_ns, last_ns, user_us, system_us })?);
    Ok(())
}

/// One run: `count` messages, with the tiny tensor or without. Its figures as JSON.
fn run(count: u64, with_tensor: bool) -> Result<Value> {
    let mut command = Command::new(std::env::current_exe()?);
    command.arg(RECEIVER_FLAG).stdout(Stdio::piped());
    let (mut child, sender) = spawn::<HostMsg>(&mut command)?;
    let tensor = Tensor::zeros(DType::U8, &[16])?;
    tensor.set::<u8>(&[0], 7)?;
    let (user0, system0) = cpu_us();
    let start = monotonic_ns();
    for seq in 0..count {
        sender.send(&HostMsg { seq, tensor: with_tensor.then(|| tensor.clone()) })?;
    }
    let sent = monotonic_ns();
    let (user1, system1) = cpu_us();
    drop(sender);
    let mut stdout = String::new();
    child.stdout.take().context("the receiver's stdout")?.read_to_string(&mut stdout)?;
    ensure!(child.wait()?.success(), "the receiver failed: {stdout}");
    let last = stdout.lines().last().context("the receiver printed nothing")?;
    let report: ReceiverReport = serde_json::from_str(last)?;
    ensure!(report.count == count, "the receiver took {} of {count} messages", report.count);
    let seconds = report.last_ns.saturating_sub(start) as f64 / 1e9;
    let n = count as f64;
    Ok(json!({
        "messages": count,
        "tensor": if with_tensor { "16 B host tensor" } else { "none" },
        "msgs_per_s": n / seconds,
        "send_calls_per_s": n / ((sent - start) as f64 / 1e9),
        "sender_cpu_us_per_msg": { "user": (user1 - user0) / n, "system": (system1 - system0) / n },
        "receiver_cpu_us_per_msg": { "user": report.user_us / n, "system": report.system_us / n },
    }))
}

impl Bench {
    /// Section `host-msgs`.
    pub(super) fn host_msgs(&mut self) -> Result<()> {
        let count = self.options.messages;
        self.progress
            .start(&format!("{count} small host messages to a receiver process, without and with a 16 B tensor"));
        let mut runs = Vec::new();
        for with_tensor in [false, true] {
            let result = run(count, with_tensor)?;
            let rate = result["msgs_per_s"].as_f64().unwrap_or(0.0);
            let label = if with_tensor { "u64 + 16 B host tensor" } else { "u64, no tensor" };
            eprintln!(
                "      {label}: {rate:.0} msg/s; CPU us per message: sender {}, receiver {}",
                result["sender_cpu_us_per_msg"], result["receiver_cpu_us_per_msg"]
            );
            self.rows.push(
                Row::new(format!("{count} small host messages (one host, no GPU), {label}"), rate, "/s")
                    .against("a turn before the drop, same kind of machine", Some(TARGET_PER_S))
                    .target(TARGET_PER_S),
            );
            runs.push(result);
        }
        self.progress.done("done");
        self.json.insert("host_msgs".into(), json!(runs));
        Ok(())
    }
}
