//! Section `cross-stages` (`tq-bench --only cross-stages`): where one cross-GPU message's time
//! goes, PeerCopy and PeerMap at 4 KiB and 1 MiB, GPU0 -> GPU1, beside the cross-GPU hand-off
//! floor of the same sizes (`handoff_floor.rs`: the same GPU work, no channel). A few seconds
//! on two GPUs.
//!
//! Each message is one-way as in section `cross` (the previous message given back first, one in
//! flight, the consumer's data usable when it answers), and each stage is read on the shared
//! `CLOCK_MONOTONIC` by the side that ends it: the producer before `send_on` and when it
//! returns; the receiver's [`MessageInfo`](tensor_queue::MessageInfo) (the sender's
//! `encoded_ns`, taken after the routes queued the copy and its fence, just before the frame is
//! written; the frame read; the tensors placed: mapped, checked, ordered on the stream; decoded,
//! when `recv` returns); the consumer's clock once the data is usable (`synchronize` of the
//! tensor's stream; PeerMap: a copy of the mapped bytes on GPU1, then `synchronize`).

use anyhow::{Context as _, Result};
use serde_json::{Value, json};
use tensor_queue::{Device, Tensor, monotonic_ns};

use super::{CrossAck, CrossMsg, Producer, RouteRun, Way, open, p50_us, size_name};
use crate::{Bench, us};
use integration_tests::percentile;

/// (bytes, warm-up trips, measured trips).
const SIZES: [(u64, usize, usize); 2] = [(4 << 10, 50, 1000), (1 << 20, 20, 500)];
/// The hand-off floor's trips at each size: (warm-up, measured).
const FLOOR_TRIPS: (usize, usize) = (100, 1000);

/// The stages, in the order they happen; the first five add up to the sixth. The seventh is the
/// producer's own view: from the frame's encoding until `send_on` returned (the frame's write
/// and the lease's bookkeeping), overlapping "frame in flight".
pub(super) const NAMES: [&str; 7] = [
    "send_on: encode, route, copy + fence queued (producer)",
    "frame: encoded -> read by the receiver",
    "place: map, check, order on the stream (receiver)",
    "decode: placed -> recv returns",
    "recv returned -> usable (GPU wait + copy + sync)",
    "one-way: send call -> usable",
    "send_on: encoded -> returned (producer; overlaps the frame)",
];

/// One message's stages in nanoseconds, in [`NAMES`] order, from the producer's clock before
/// the send call (`start`) and when it returned (`returned`), and the consumer's answer.
pub(super) fn stages(start: u64, returned: u64, ack: &CrossAck) -> Result<[u64; 7]> {
    let &[_sent, encoded, arrived, imported, decoded] = ack.stages_ns.as_slice() else {
        anyhow::bail!("the consumer's answer has {} stage marks, not 5", ack.stages_ns.len());
    };
    let usable = ack.usable_ns;
    Ok([
        encoded.saturating_sub(start),
        arrived.saturating_sub(encoded),
        imported.saturating_sub(arrived),
        decoded.saturating_sub(imported),
        usable.saturating_sub(decoded),
        usable.saturating_sub(start),
        returned.saturating_sub(encoded),
    ])
}

/// What one route measured: per size, each stage's samples.
struct StagesRun {
    way: Way,
    run: RouteRun,
    sizes: Vec<(u64, Vec<Vec<u64>>)>,
}

/// `warmup + trips` one-way messages of each tensor of `sized` over `way`, stage by stage.
fn measure(producer: &Producer, way: Way, sized: &[(u64, usize, usize, &Tensor)]) -> Result<StagesRun> {
    let mut run = RouteRun::default();
    let (consumer, mut channel) = open(producer, way, &mut run)?;
    let mut id = 0u64;
    let mut sizes = Vec::new();
    for &(bytes, warmup, trips, tensor) in sized {
        let what = format!("1 x {} (stages)", size_name(bytes));
        let mut samples: Vec<Vec<u64>> = vec![Vec::with_capacity(trips); NAMES.len()];
        for i in 0..warmup + trips {
            channel.await_release(&mut run.notes);
            id += 1;
            let start = monotonic_ns();
            let msg = CrossMsg { id, sent_ns: start, tensors: vec![tensor.clone()] };
            channel.sender.send_on(&msg, producer.stream).with_context(|| format!("sending {what}"))?;
            let returned = monotonic_ns();
            let ack = channel.answer(id, &what)?;
            if run.path.is_empty() {
                run.path = ack.path.clone();
                run.stream_device = ack.stream_device.clone();
            }
            if i >= warmup {
                for (stage, value) in samples.iter_mut().zip(stages(start, returned, &ack)?) {
                    stage.push(value);
                }
            }
        }
        sizes.push((bytes, samples));
    }
    super::close(consumer, channel, &mut run)?;
    Ok(StagesRun { way, run, sizes })
}

/// The markdown table: a row per stage, a column per route and size, the floor last.
fn table(runs: &mut [StagesRun], floor: &[(u64, Option<f64>)]) -> Vec<String> {
    let mut lines = Vec::new();
    let mut header = vec!["stage p50 us".to_string()];
    for run in runs.iter() {
        for (bytes, _) in &run.sizes {
            header.push(format!("{} {}", run.way.label(), size_name(*bytes)));
        }
    }
    lines.push(format!("| {} |", header.join(" | ")));
    lines.push(format!("|{}", " --- |".repeat(header.len())));
    for (index, name) in NAMES.iter().enumerate() {
        let mut cells = vec![name.to_string()];
        for run in runs.iter_mut() {
            for (_, samples) in &mut run.sizes {
                cells.push(if samples[index].is_empty() {
                    "-".into()
                } else {
                    format!("{:.1}", p50_us(&mut samples[index]))
                });
            }
        }
        lines.push(format!("| {} |", cells.join(" | ")));
    }
    let mut cells = vec!["hand-off floor: signal + socket + pull copy + sync, one-way".to_string()];
    for run in runs.iter() {
        for (bytes, _) in &run.sizes {
            let at = floor.iter().find(|(b, _)| b == bytes).and_then(|(_, t)| *t);
            cells.push(at.map_or("-".into(), |t| format!("{t:.1}")));
        }
    }
    lines.push(format!("| {} |", cells.join(" | ")));
    lines
}

/// Prints the section's table (`None`: it did not run).
pub fn print_table(section: Option<&Value>) {
    let Some(section) = section else { return };
    if !super::print_opening(section, "cross-GPU stages", "cross-GPU stages, one message one-way, GPU0 -> GPU1") {
        return;
    }
    for line in super::strings_of(section, "table") {
        println!("{line}");
    }
    for note in super::strings_of(section, "notes") {
        println!("note: {note}");
    }
}

impl Bench {
    /// Section `cross-stages`; skipped (with why) without 2 GPUs.
    pub(crate) fn cross_stages(&mut self) -> Result<()> {
        self.progress.start("cross-GPU stages: PeerCopy and PeerMap, 4 KiB and 1 MiB, and the hand-off floor");
        if let Some(reason) = self.two_gpus_missing() {
            self.progress.done(&format!("skipped: {reason}"));
            self.json.insert("cross_stages".into(), json!({ "skipped": reason }));
            return Ok(());
        }
        let gpu = self.gpu.as_ref().context("no GPU")?;
        let ctx0 = gpu.context.clone();
        let ctx1 = tensor_queue::Context::on_ordinal(1)?;
        let (gpu0, gpu1) = (ctx0.device().uuid()?, ctx1.device().uuid()?);
        let gpus = format!("{} {gpu0} -> {} {gpu1}", ctx0.device().name()?, ctx1.device().name()?);
        let mut notes = Vec::new();
        let mut floor = Vec::new();
        for (bytes, _, _) in SIZES {
            let (warmup, trips) = FLOOR_TRIPS;
            match crate::handoff_floor::cross_one_way(&ctx0, bytes as usize, warmup, trips) {
                Ok(mut times) => floor.push((bytes, Some(p50_us(&mut times)))),
                Err(error) => {
                    notes.push(format!("hand-off floor, {}: FAILED: {error:#}", size_name(bytes)));
                    floor.push((bytes, None));
                }
            }
        }
        let tensors = SIZES.iter().map(|&(bytes, _, _)| self.tensor(bytes, bytes)).collect::<Result<Vec<_>>>()?;
        self.synchronize()?;
        let gpu = self.gpu.as_ref().context("no GPU")?;
        let producer = Producer {
            stream: &gpu.stream,
            gpu0,
            gpu1,
            spin: std::time::Duration::from_micros(self.options.spin_us),
            sized: Vec::new(),
            many: Vec::new(),
        };
        let sized: Vec<(u64, usize, usize, &Tensor)> =
            SIZES.iter().zip(&tensors).map(|(&(b, w, t), tensor)| (b, w, t, tensor)).collect();
        let mut runs = Vec::new();
        let mut routes = serde_json::Map::new();
        for way in [Way::Copy, Way::Map] {
            match measure(&producer, way, &sized) {
                Ok(run) => {
                    notes.extend(run.run.notes.iter().map(|n| format!("{}: {n}", way.label())));
                    runs.push(run);
                }
                Err(error) => {
                    notes.push(format!("{} FAILED: {error:#}", way.label()));
                    routes.insert(way.arg().into(), json!({ "error": format!("{error:#}") }));
                }
            }
        }
        for run in &mut runs {
            let sizes: Vec<Value> = run
                .sizes
                .iter_mut()
                .map(|(bytes, samples)| {
                    let stages: Vec<Value> = NAMES
                        .iter()
                        .zip(samples.iter_mut())
                        .map(|(name, values)| {
                            let (p50, p99) = if values.is_empty() {
                                (None, None)
                            } else {
                                (Some(p50_us(values)), Some(us(percentile(values, 99.0))))
                            };
                            json!({ "stage": name, "n": values.len(), "p50_us": p50, "p99_us": p99 })
                        })
                        .collect();
                    json!({ "bytes": bytes, "stages": stages })
                })
                .collect();
            routes.insert(
                run.way.arg().into(),
                json!({ "chosen_route": run.run.chosen, "path": run.run.path, "stream_device": run.run.stream_device, "sizes": sizes }),
            );
        }
        let table = table(&mut runs, &floor);
        let floor_json: Vec<Value> = floor.iter().map(|(b, t)| json!({ "bytes": b, "p50_us": t })).collect();
        for line in &table {
            eprintln!("      {line}");
        }
        self.progress.done(&format!("{} routes measured", runs.len()));
        self.json.insert(
            "cross_stages".into(),
            json!({ "gpus": gpus, "stages": NAMES, "routes": routes, "handoff_floor": floor_json, "table": table, "notes": notes }),
        );
        Ok(())
    }

    /// Why the cross-device sections cannot run here (`None`: two GPUs are there).
    pub(crate) fn two_gpus_missing(&self) -> Option<String> {
        match (&self.gpu, Device::count()) {
            (None, _) => Some("needs 2 GPUs; no GPU here".to_string()),
            (Some(_), Ok(n)) if n < 2 => Some(format!("needs 2 GPUs; this process sees {n}")),
            (Some(_), Err(error)) => Some(format!("needs 2 GPUs; counting them failed: {error}")),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stages tile the one-way time, and a short answer is an error, not a panic.
    #[test]
    fn stages_add_up() {
        let ack =
            CrossAck { stages_ns: vec![1_000, 3_000, 7_000, 8_000, 9_500], usable_ns: 20_000, ..Default::default() };
        let s = stages(900, 4_000, &ack).unwrap();
        assert_eq!(s, [2_100, 4_000, 1_000, 1_500, 10_500, 19_100, 1_000]);
        assert_eq!(s[..5].iter().sum::<u64>(), s[5]);
        assert!(stages(0, 0, &CrossAck::default()).is_err());
        let mut runs = vec![StagesRun {
            way: Way::Copy,
            run: RouteRun::default(),
            sizes: vec![(4096, vec![vec![1_000]; NAMES.len()]), (1 << 20, vec![Vec::new(); NAMES.len()])],
        }];
        let lines = table(&mut runs, &[(4096, Some(16.9)), (1 << 20, None)]);
        assert_eq!(lines.len(), 2 + NAMES.len() + 1);
        assert!(lines[0].contains("PeerCopy 4 KiB") && lines[0].contains("PeerCopy 1 MiB"));
        assert!(lines.last().unwrap().ends_with("| 16.9 | - |"), "{}", lines.last().unwrap());
        print_table(Some(&json!({ "gpus": "a -> b", "table": lines, "notes": ["n"] })));
        print_table(Some(&json!({ "skipped": "why" })));
    }
}
