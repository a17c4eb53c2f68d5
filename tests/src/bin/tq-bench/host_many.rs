//! Section `host-many` (issue 26's "1,024 x 4 KiB in one message", host tensors only, so it runs
//! without a GPU): one message of 1,024 host tensors of 4 KiB each, one-way from `send` to the
//! receiver holding usable tensors (`recv` returned), against one message of one 4 KiB tensor in
//! the same run. What it measures is the channel's cost per tensor on both sides (descriptors,
//! storage records, the tensors' own allocations): host tensors move no bytes, the receiver maps
//! the sender's pages. The receiver is this binary again ([`RECEIVER_FLAG`]) over a channel from
//! [`tensor_queue::spawn`]; each message is sent once the previous one was released, so no
//! message waits behind another. Times are `CLOCK_MONOTONIC` of both processes (one clock).
//!
//! The floor, in the same run: the same message encoded and decoded in this process with no
//! channel ([`tensor_queue::testing::serde_floor`]: the serde of the message and its 1,024
//! tensors made again from one storage), so that what the channel adds is told apart from what
//! any message of 1,024 `Tensor`s costs.

use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tensor_queue::{DType, Error, Tensor, from_parent, monotonic_ns, spawn};

use integration_tests::serde_floor_ns;

use super::{Bench, Row, summary};

/// The first argument of a receiver process of this section.
pub const RECEIVER_FLAG: &str = "--host-many-receiver";

/// Tensors in the many-tensor message, and the bytes of each.
const MANY: usize = 1024;
const TENSOR_BYTES: u64 = 4096;
/// Messages measured per kind, after [`WARMUP`] unmeasured ones.
const MESSAGES: usize = 300;
const WARMUP: usize = 30;

/// One message: its tensors, each holding its index in its first byte.
#[derive(Serialize, Deserialize)]
struct Many {
    tensors: Vec<Tensor>,
}

/// What the receiver prints last: per message, the stages in ns (see `MessageInfo`).
#[derive(Serialize, Deserialize)]
struct Report {
    /// send -> `recv` returned.
    one_way: Vec<u64>,
    /// send -> encoded (the sender's encoding, routes and descriptors).
    encode: Vec<u64>,
    /// encoded -> read from the socket.
    socket: Vec<u64>,
    /// read -> tensors placed (decoding the descriptors, mapping, storage records).
    import: Vec<u64>,
    /// placed -> `recv` returned (the serde payload, the tensors handed back).
    decode: Vec<u64>,
}

/// The receiver process: takes messages until the sender hangs up, checks each, prints a
/// [`Report`].
pub fn receiver() -> Result<()> {
    let mut messages = from_parent::<Many>()?;
    let mut report = Report { one_way: vec![], encode: vec![], socket: vec![], import: vec![], decode: vec![] };
    loop {
        let (message, info) = match messages.recv_with_info(None) {
            Ok(received) => received,
            Err(Error::Disconnected) => break,
            Err(error) => return Err(error.into()),
        };
        let usable = monotonic_ns();
        report.one_way.push(usable - info.sent_ns);
        report.encode.push(info.encoded_ns - info.sent_ns);
        report.socket.push(info.arrived_ns.saturating_sub(info.encoded_ns));
        report.import.push(info.imported_ns - info.arrived_ns);
        report.decode.push(usable - info.imported_ns);
        for (i, tensor) in message.tensors.iter().enumerate() {
            ensure!(tensor.get::<u8>(&[0])? == i as u8, "tensor {i} arrived with other contents");
        }
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// One run: `MESSAGES` messages of `count` tensors. The receiver's report.
fn run(count: usize) -> Result<Report> {
    let mut command = Command::new(std::env::current_exe()?);
    command.arg(RECEIVER_FLAG).stdout(Stdio::piped());
    let (mut child, sender) = spawn::<Many>(&mut command)?;
    let message = Many { tensors: tensors(count)? };
    for _ in 0..WARMUP + MESSAGES {
        sender.send(&message)?;
        ensure!(sender.wait_released(Duration::from_secs(30)), "the receiver held a message for 30 s");
    }
    drop(sender);
    let mut stdout = String::new();
    child.stdout.take().context("the receiver's stdout")?.read_to_string(&mut stdout)?;
    ensure!(child.wait()?.success(), "the receiver failed: {stdout}");
    let mut report: Report = serde_json::from_str(stdout.lines().last().context("the receiver printed nothing")?)?;
    ensure!(report.one_way.len() == WARMUP + MESSAGES, "the receiver took {} messages", report.one_way.len());
    for stage in [&mut report.one_way, &mut report.encode, &mut report.socket, &mut report.import, &mut report.decode] {
        stage.drain(..WARMUP);
    }
    Ok(report)
}

/// `count` host tensors of 4 KiB, each holding its index in its first byte.
fn tensors(count: usize) -> Result<Vec<Tensor>> {
    let mut tensors = Vec::with_capacity(count);
    for i in 0..count {
        let tensor = Tensor::zeros(DType::U8, &[TENSOR_BYTES])?;
        tensor.set::<u8>(&[0], i as u8)?;
        tensors.push(tensor);
    }
    Ok(tensors)
}

/// The stages' summaries (p50 and more, in us).
fn stages(report: &mut Report) -> Value {
    json!({
        "one_way": summary(&mut report.one_way),
        "encode": summary(&mut report.encode),
        "socket": summary(&mut report.socket),
        "import": summary(&mut report.import),
        "decode": summary(&mut report.decode),
    })
}

impl Bench {
    /// Section `host-many`.
    pub(super) fn host_many(&mut self) -> Result<()> {
        self.progress.start(&format!(
            "one message of {MANY} x 4 KiB host tensors, one-way, against one of 1 x 4 KiB ({MESSAGES} each)"
        ));
        let one = stages(&mut run(1)?);
        let many = stages(&mut run(MANY)?);
        let floor = summary(&mut serde_floor_ns(&tensors(MANY)?, (WARMUP, MESSAGES))?);
        let p50 = |v: &Value| v["one_way"]["p50_us"].as_f64().unwrap_or(0.0);
        let (one_us, many_us) = (p50(&one), p50(&many));
        let floor_us = floor["p50_us"].as_f64().unwrap_or(0.0);
        let per_tensor = many_us / MANY as f64;
        let marginal = (many_us - one_us) / (MANY - 1) as f64;
        self.progress.done(&format!(
            "{MANY} tensors: p50 {many_us:.1} us ({per_tensor:.3} us per tensor, {marginal:.3} above one tensor's \
             message); 1 tensor: p50 {one_us:.1} us; in-process floor (no channel) p50 {floor_us:.1} us; stages p50 \
             (us) of the {MANY}: encode {}, socket {}, import {}, decode {}",
            many["encode"]["p50_us"], many["socket"]["p50_us"], many["import"]["p50_us"], many["decode"]["p50_us"]
        ));
        self.rows.push(
            Row::new(format!("{MANY} x 4 KiB host tensors in one message, one-way send->usable p50"), many_us, "us")
                .against("1 x 4 KiB host tensor, one message, p50", Some(one_us)),
        );
        self.rows.push(Row::new(format!("{MANY} x 4 KiB host tensors in one message, per tensor"), per_tensor, "us"));
        self.rows.push(
            Row::new(
                format!("{MANY} x 4 KiB host tensors, in-process floor (serde + {MANY} tensors made, no channel) p50"),
                floor_us,
                "us",
            )
            .against("the channel's one-way p50", Some(many_us)),
        );
        self.json.insert(
            "host_many".into(),
            json!({ "tensors": MANY, "tensor_bytes": TENSOR_BYTES, "messages": MESSAGES, "many": many, "one": one,
                    "floor": floor, "per_tensor_us": per_tensor, "marginal_per_tensor_us": marginal }),
        );
        Ok(())
    }
}
