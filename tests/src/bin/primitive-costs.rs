//! Prints the cost of each CUDA IPC primitive on this machine, next to the figures measured for
//! `docs/GPU.md`: handle export, open and close in another process, VMM export, VMM import and
//! map in another process, event record, and a cross-process event wait.
//!
//! Run on the GPU machine (`target/gpu-bundle/bin/primitive-costs`); it starts `ipc-helper` for the
//! other side.

use std::os::fd::AsFd;
use std::time::Instant;

use anyhow::{Context as _, Result, ensure};
use integration_tests::{Helper, encode_u64s, gpu_skip_reason, micros, percentile};
use ipc_core::{Context, DeviceBuffer, DeviceMemory, Event, Stream, VmmAllocation};

const MB64: usize = 64 << 20;

struct Row {
    what: String,
    samples: Vec<u64>,
    reference: &'static str,
}

fn main() -> Result<()> {
    if let Some(reason) = gpu_skip_reason() {
        println!("primitive-costs: skipped, {reason}");
        return Ok(());
    }
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    let mut driver_version = 0;
    // SAFETY: a valid out-pointer.
    unsafe { cuda_sys::driver!(cuDriverGetVersion(&mut driver_version)) }?;
    let device = context.device();
    println!("device: {} ({}), CUDA driver API {driver_version}", device.name()?, device.uuid()?);

    let rows = vec![
        export_legacy(&context)?,
        open_close_elsewhere(&context)?,
        export_vmm(&context)?,
        import_vmm_elsewhere(&context)?,
        record_event(&context, &stream)?,
        wait_event_same_process(&context, &stream)?,
        wait_event_elsewhere(&context, &stream)?,
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>();

    println!();
    println!("| primitive | n | p50 us | p99 us | GPU.md (H200) |");
    println!("| --- | --- | --- | --- | --- |");
    for mut row in rows {
        let n = row.samples.len();
        let p50 = micros(percentile(&mut row.samples, 50.0));
        let p99 = micros(percentile(&mut row.samples, 99.0));
        println!("| {} | {n} | {p50:.1} | {p99:.1} | {} |", row.what, row.reference);
    }
    Ok(())
}

fn time<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, u64)> {
    let start = Instant::now();
    let value = f()?;
    Ok((value, start.elapsed().as_nanos() as u64))
}

fn export_legacy(context: &std::sync::Arc<Context>) -> Result<Vec<Row>> {
    let mut samples = Vec::new();
    for _ in 0..50 {
        let buffer = DeviceBuffer::alloc(context, MB64)?;
        samples.push(time(|| Ok(buffer.export()?))?.1);
    }
    Ok(vec![Row { what: "cuIpcGetMemHandle, fresh 64 MB cuMemAlloc".into(), samples, reference: "2 us" }])
}

fn open_close_elsewhere(context: &std::sync::Arc<Context>) -> Result<Vec<Row>> {
    let helper = Helper::spawn(&["bench-open"], &[])?;
    let (mut opens, mut closes) = (Vec::new(), Vec::new());
    let buffers = (0..50).map(|_| DeviceBuffer::alloc(context, MB64)).collect::<Result<Vec<_>, _>>()?;
    for buffer in &buffers {
        helper.connection.send(&buffer.export()?.to_bytes(), &[])?;
        let reply = helper.recv_u64s()?;
        opens.push(reply[0]);
        closes.push(reply[1]);
    }
    helper.connection.send(b"done", &[])?;
    helper.finish()?;
    Ok(vec![
        Row { what: "cuIpcOpenMemHandle in another process".into(), samples: opens, reference: "53 us (p99 107)" },
        Row { what: "cuIpcCloseMemHandle in another process".into(), samples: closes, reference: "34 us (p99 68)" },
    ])
}

/// VMM export at several sizes, with the allocation itself: whether a channel's first chunk
/// would be cheaper to make and export if it were smaller (the first message pays both).
fn export_vmm(context: &std::sync::Arc<Context>) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for mb in [2, 8, 64, 256] {
        let (mut creates, mut exports) = (Vec::new(), Vec::new());
        for _ in 0..20 {
            let (memory, create) = time(|| Ok(VmmAllocation::new(context, mb << 20)?))?;
            creates.push(create);
            exports.push(time(|| Ok(memory.export()?))?.1);
        }
        let reference = if mb == 64 { "730 us" } else { "-" };
        let what = format!("cuMemCreate + reserve + map, {mb} MB");
        rows.push(Row { what, samples: creates, reference: "-" });
        rows.push(Row { what: format!("cuMemExportToShareableHandle (fd), {mb} MB"), samples: exports, reference });
    }
    Ok(rows)
}

fn import_vmm_elsewhere(context: &std::sync::Arc<Context>) -> Result<Vec<Row>> {
    let helper = Helper::spawn(&["bench-vmm"], &[])?;
    let mut samples = Vec::new();
    for _ in 0..20 {
        let memory = VmmAllocation::new(context, MB64)?;
        let fd = memory.export()?;
        let mut message = encode_u64s(&[memory.len() as u64]);
        message.extend_from_slice(&context.device().uuid()?.0);
        helper.connection.send(&message, &[fd.as_fd()])?;
        samples.push(helper.recv_u64s()?[0]);
    }
    helper.connection.send(b"done", &[])?;
    helper.finish()?;
    Ok(vec![Row {
        what: "import fd + reserve + map + access, 64 MB, other process".into(),
        samples,
        reference: "129 us",
    }])
}

fn record_event(context: &std::sync::Arc<Context>, stream: &Stream) -> Result<Vec<Row>> {
    let event = Event::interprocess(context)?;
    let mut samples = Vec::new();
    for _ in 0..2000 {
        samples.push(time(|| Ok(event.record(stream)?))?.1);
    }
    stream.synchronize()?;
    Ok(vec![Row { what: "cuEventRecord, interprocess event".into(), samples, reference: "1.2 us" }])
}

fn wait_event_same_process(context: &std::sync::Arc<Context>, stream: &Stream) -> Result<Vec<Row>> {
    let event = Event::new(context)?;
    event.record(stream)?;
    stream.synchronize()?;
    let mut samples = Vec::new();
    for _ in 0..2000 {
        samples.push(
            time(|| {
                stream.wait_event(&event)?;
                Ok(stream.synchronize()?)
            })?
            .1,
        );
    }
    Ok(vec![Row { what: "ordinary event, same process: wait + sync".into(), samples, reference: "0.8 us (H100)" }])
}

fn wait_event_elsewhere(context: &std::sync::Arc<Context>, stream: &Stream) -> Result<Vec<Row>> {
    let event = Event::interprocess(context)?;
    event.record(stream)?;
    stream.synchronize()?;
    ensure!(event.is_complete()?, "the event completed");
    let helper = Helper::spawn(&["bench-event"], &[])?;
    helper.connection.send(&event.export()?.to_bytes(), &[])?;
    helper.connection.send(&encode_u64s(&[500]), &[])?;
    let samples = helper.recv_u64s().context("event wait timings")?;
    helper.finish()?;
    Ok(vec![Row {
        what: "imported interprocess event, other process: wait + sync".into(),
        samples,
        reference: "141 us",
    }])
}
