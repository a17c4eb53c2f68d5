//! Tests that need one or two GPUs. Where there are none, each is reported as
//! `ignored, no GPU here: ...` with the reason, never as a pass.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail, ensure};
use integration_tests::{GpuTest, Helper, encode_u64s, run_gpu_tests};
use ipc_core::{
    Context, Device, DeviceBuffer, DeviceMemory, Error, Event, SharedMemory, Stream, Topology, Uuid, VmmAllocation,
    copy_peer_async,
};
use kernels::{Kernels, StridedLayout, reference};

fn main() {
    run_gpu_tests(vec![
        GpuTest { name: "kernels_match_the_cpu_reference", gpus: 1, run: kernels_match_the_cpu_reference },
        GpuTest { name: "strided_pack_and_unpack_round_trip", gpus: 1, run: strided_pack_and_unpack_round_trip },
        GpuTest { name: "matmul_matches_the_cpu", gpus: 1, run: matmul_matches_the_cpu },
        GpuTest { name: "legacy_ipc_handle_crosses_processes", gpus: 1, run: legacy_ipc_handle_crosses_processes },
        GpuTest { name: "vmm_descriptor_crosses_processes", gpus: 1, run: vmm_descriptor_crosses_processes },
        GpuTest {
            name: "interprocess_event_orders_the_consumer",
            gpus: 1,
            run: interprocess_event_orders_the_consumer,
        },
        GpuTest {
            name: "without_the_wait_the_consumer_sees_unfinished_data",
            gpus: 1,
            run: without_the_wait_the_consumer_sees_unfinished_data,
        },
        GpuTest {
            name: "pinned_shared_memory_is_readable_by_the_gpu",
            gpus: 1,
            run: pinned_shared_memory_is_readable_by_the_gpu,
        },
        GpuTest { name: "bad_use_gives_typed_errors", gpus: 1, run: bad_use_gives_typed_errors },
        GpuTest { name: "topology_reports_every_pair", gpus: 2, run: topology_reports_every_pair },
        GpuTest { name: "peer_copy_between_two_gpus", gpus: 2, run: peer_copy_between_two_gpus },
    ]);
}

fn setup() -> Result<(Arc<Context>, Stream, Arc<Kernels>)> {
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    let kernels = Kernels::get(&context)?;
    Ok((context, stream, kernels))
}

fn kernels_match_the_cpu_reference() -> Result<()> {
    let (context, stream, kernels) = setup()?;
    let buffer = DeviceBuffer::alloc(&context, 5 << 20)?;
    for (offset, len, seed) in [(0, 1, 1), (0, 7, 2), (5, 4099, 3), (0, 5 << 20, 4), (3, (5 << 20) - 3, 5)] {
        kernels.fill(&buffer, offset, len, seed, &stream)?;
        let gpu = kernels.checksum(&buffer, offset, len, &stream)?;
        let cpu = reference::checksum(&reference::pattern(len, seed));
        ensure!(gpu == cpu, "offset {offset} len {len}: GPU checksum {gpu:#x}, CPU {cpu:#x}");
        let mut host = vec![0u8; len];
        buffer.copy_to_host(offset, &mut host)?;
        ensure!(host == reference::pattern(len, seed), "offset {offset} len {len}: the bytes differ");
    }
    // The read kernel's two paths: 8-byte aligned (word loads), and 16-byte aligned with an odd
    // word count (pair loads and a last word).
    kernels.fill(&buffer, 0, 5 << 20, 6, &stream)?;
    let pattern = reference::pattern(5 << 20, 6);
    for (offset, len) in [(8, (5 << 20) - 16), (16, 8 * 100_001)] {
        let counter = DeviceBuffer::alloc(&context, 8)?;
        counter.memset_async(0, &stream)?;
        kernels.read(&buffer, offset, len, &counter, &stream)?;
        stream.synchronize()?;
        let mut sum = [0u8; 8];
        counter.copy_to_host(0, &mut sum)?;
        let expected = reference::word_sum(&pattern[offset..offset + len]);
        ensure!(u64::from_le_bytes(sum) == expected, "read at {offset}: GPU word sum {sum:?}, CPU {expected:#x}");
    }
    let counter = DeviceBuffer::alloc(&context, 8)?;
    ensure!(kernels.read(&buffer, 3, 8, &counter, &stream).is_err(), "an unaligned read was accepted");
    Ok(())
}

/// CPU model of the pack kernel: element `i` of the packed form, row-major over `shape`.
fn cpu_pack(src: &[u8], shape: &[u64], strides: &[i64], elem: usize, base: usize) -> Vec<u8> {
    let numel: u64 = shape.iter().product();
    let mut out = Vec::with_capacity(numel as usize * elem);
    for linear in 0..numel {
        let (mut rest, mut offset) = (linear, 0i64);
        for d in (0..shape.len()).rev() {
            offset += (rest % shape[d]) as i64 * strides[d];
            rest /= shape[d];
        }
        let at = (base as i64 + offset * elem as i64) as usize;
        out.extend_from_slice(&src[at..at + elem]);
    }
    out
}

fn strided_pack_and_unpack_round_trip() -> Result<()> {
    let (context, stream, kernels) = setup()?;
    for elem in [1usize, 2, 4, 8] {
        // A (4, 5, 6) tensor viewed with its axes permuted to (6, 4, 5), then a reversed 1-D view.
        let cases: [(Vec<u64>, Vec<i64>, usize); 3] = [
            (vec![6, 4, 5], vec![1, 30, 6], 0),
            (vec![120], vec![-1], 119 * elem),
            (vec![2, 1, 3, 1, 2, 1, 2, 5], vec![60, 7, 20, 3, 10, 1, 5, 1], 0),
        ];
        let bytes = 120 * elem;
        let source = DeviceBuffer::alloc(&context, bytes)?;
        kernels.fill(&source, 0, bytes, 9, &stream)?;
        let host_source = reference::pattern(bytes, 9);
        for (shape, strides, base) in cases {
            let layout = StridedLayout::new(&shape, &strides, elem)?;
            let packed = DeviceBuffer::alloc(&context, layout.packed_bytes() as usize)?;
            kernels.pack(&source, base, &layout, &packed, 0, &stream)?;
            let expected = cpu_pack(&host_source, &shape, &strides, elem, base);
            let gpu = kernels.checksum(&packed, 0, packed.len(), &stream)?;
            ensure!(gpu == reference::checksum(&expected), "pack {shape:?}/{strides:?} x{elem}");
            let restored = DeviceBuffer::alloc(&context, bytes)?;
            restored.memset_async(0, &stream)?;
            kernels.unpack(&packed, 0, &layout, &restored, base, &stream)?;
            let mut host = vec![0u8; bytes];
            stream.synchronize()?;
            restored.copy_to_host(0, &mut host)?;
            ensure!(cpu_pack(&host, &shape, &strides, elem, base) == expected, "unpack {shape:?} x{elem}");
        }
        let too_far = StridedLayout::new(&[121], &[1], elem)?;
        let out = DeviceBuffer::alloc(&context, 121 * elem)?;
        let refused = kernels.pack(&source, 0, &too_far, &out, 0, &stream);
        ensure!(matches!(refused, Err(Error::OutOfBounds { .. })), "an out-of-bounds view is refused");
    }
    Ok(())
}

fn matmul_matches_the_cpu() -> Result<()> {
    let (context, stream, kernels) = setup()?;
    let (m, n, k) = (33u32, 47u32, 65u32);
    let a: Vec<f32> = (0..m * k).map(|i| ((i % 7) as f32) - 3.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i % 5) as f32) * 0.5).collect();
    let upload = |values: &[f32]| -> Result<DeviceBuffer> {
        let buffer = DeviceBuffer::alloc(&context, values.len() * 4)?;
        buffer.copy_from_host(0, bytemuck::cast_slice(values))?;
        Ok(buffer)
    };
    let (da, db) = (upload(&a)?, upload(&b)?);
    let dc = DeviceBuffer::alloc(&context, (m * n * 4) as usize)?;
    kernels.matmul_f32(&da, &db, &dc, (m, n, k), &stream)?;
    stream.synchronize()?;
    let mut c = vec![0u8; (m * n * 4) as usize];
    dc.copy_to_host(0, &mut c)?;
    for row in 0..m as usize {
        for col in 0..n as usize {
            let expected: f32 = (0..k as usize).map(|i| a[row * k as usize + i] * b[i * n as usize + col]).sum();
            let at = (row * n as usize + col) * 4;
            let got = f32::from_le_bytes(c[at..at + 4].try_into()?);
            ensure!((got - expected).abs() < 1e-3, "c[{row}][{col}] = {got}, expected {expected}");
        }
    }
    Ok(())
}

fn legacy_ipc_handle_crosses_processes() -> Result<()> {
    let (context, stream, kernels) = setup()?;
    let len = 64 << 20;
    let buffer = DeviceBuffer::alloc(&context, len)?;
    kernels.fill(&buffer, 0, len, 11, &stream)?;
    let expected = kernels.checksum(&buffer, 0, len, &stream)?;
    ensure!(expected == reference::checksum(&reference::pattern(len, 11)));
    let helper = Helper::spawn(&["legacy-import"], &[])?;
    helper.connection.send(&buffer.export()?.to_bytes(), &[])?;
    let seen = helper.recv_u64s()?[0];
    helper.finish()?;
    ensure!(seen == expected, "the importer's GPU checksum {seen:#x} differs from {expected:#x}");
    Ok(())
}

fn vmm_descriptor_crosses_processes() -> Result<()> {
    let (context, stream, kernels) = setup()?;
    let memory = VmmAllocation::new(&context, 48 << 20)?;
    kernels.fill(&memory, 0, memory.len(), 12, &stream)?;
    let expected = kernels.checksum(&memory, 0, memory.len(), &stream)?;
    let fd = memory.export()?;
    let helper = Helper::spawn(&["vmm-import"], &[])?;
    let mut message = encode_u64s(&[memory.len() as u64]);
    message.extend_from_slice(&context.device().uuid()?.0);
    helper.connection.send(&message, &[std::os::fd::AsFd::as_fd(&fd)])?;
    let seen = helper.recv_u64s()?[0];
    helper.finish()?;
    ensure!(seen == expected, "the importer's GPU checksum {seen:#x} differs from {expected:#x}");
    Ok(())
}

/// The producer queues a kernel that spins for `delay` and only then writes the pattern, records
/// an interprocess event and sends both handles at once, without synchronising. Returns the
/// consumer's checksum and the checksum of the final data.
fn slow_producer_fast_consumer(skip_wait: bool) -> Result<(u64, u64)> {
    let (context, stream, kernels) = setup()?;
    let len = 16 << 20;
    let buffer = DeviceBuffer::alloc(&context, len)?;
    buffer.memset_async(0, &stream)?;
    stream.synchronize()?;
    let args: &[&str] = if skip_wait { &["event-wait", "--skip-wait"] } else { &["event-wait"] };
    let helper = Helper::spawn(args, &[])?;
    ensure!(helper.recv_u64s()? == [1], "the consumer did not get ready");
    let event = Event::interprocess(&context)?;
    kernels.spin_then_fill(&buffer, len, 21, Duration::from_millis(1500), &stream)?;
    event.record(&stream)?;
    let mut message = buffer.export()?.to_bytes().to_vec();
    message.extend_from_slice(&event.export()?.to_bytes());
    helper.connection.send(&message, &[])?;
    let seen = helper.recv_u64s()?[0];
    helper.finish()?;
    stream.synchronize()?;
    Ok((seen, reference::checksum(&reference::pattern(len, 21))))
}

fn interprocess_event_orders_the_consumer() -> Result<()> {
    let (seen, expected) = slow_producer_fast_consumer(false)?;
    ensure!(seen == expected, "the consumer ran before the producer's kernel finished");
    Ok(())
}

/// Proves the ordering test can fail: with the wait left out, the consumer reads early.
fn without_the_wait_the_consumer_sees_unfinished_data() -> Result<()> {
    let (seen, expected) = slow_producer_fast_consumer(true)?;
    ensure!(seen != expected, "without the wait the consumer still saw final data: the ordering test proves nothing");
    Ok(())
}

fn pinned_shared_memory_is_readable_by_the_gpu() -> Result<()> {
    let (context, stream, kernels) = setup()?;
    let len = 3 << 20;
    let shared = SharedMemory::create("pinned-test", len)?;
    shared.write(0, &reference::pattern(len, 31))?;
    let pinned = shared.pin(&context)?;
    let sum = kernels.checksum(&pinned, 0, len, &stream)?;
    ensure!(sum == reference::checksum(&reference::pattern(len, 31)), "the GPU read other bytes");
    Ok(())
}

fn bad_use_gives_typed_errors() -> Result<()> {
    let (context, _stream, _kernels) = setup()?;
    let count = Device::count()?;
    ensure!(matches!(Device::get(count + 3), Err(Error::NoSuchDevice { .. })));
    ensure!(matches!(Device::by_uuid(&Uuid([0xEE; 16])), Err(Error::UnknownDevice(_))));
    let granularity = VmmAllocation::granularity(&context)?;
    let closed = {
        let file = std::fs::File::open("/dev/null")?;
        file.as_raw_fd()
    };
    ensure!(matches!(VmmAllocation::import(&context, closed, granularity), Err(Error::BadDescriptor { .. })));
    let not_vmm = SharedMemory::create("not-vmm", 4096)?;
    match VmmAllocation::import(&context, not_vmm.fd().as_raw_fd(), granularity) {
        Err(Error::Cuda(_)) => {}
        other => bail!("importing a memfd as VMM gave {other:?}"),
    }
    let buffer = DeviceBuffer::alloc(&context, 16)?;
    ensure!(matches!(buffer.copy_from_host(10, &[0; 8]), Err(Error::OutOfBounds { .. })));
    ensure!(matches!(DeviceBuffer::alloc(&context, 0), Err(Error::InvalidArgument(_))));
    ensure!(matches!(Event::new(&context)?.export(), Err(Error::InvalidArgument(_))));
    Ok(())
}

fn topology_reports_every_pair() -> Result<()> {
    let topology = Topology::query()?;
    println!("{topology}");
    let n = topology.devices.len() as i32;
    ensure!(topology.links.len() as i32 == n * (n - 1), "one link per ordered pair");
    for link in &topology.links {
        let back = topology.link(link.to, link.from).expect("the reverse link is listed");
        ensure!(link.can_access_peer == back.can_access_peer, "peer access is symmetric here");
    }
    // Check the claim against the driver: peer access really works where it is reported.
    let (a, b) = (Context::on_ordinal(0)?, Context::on_ordinal(1)?);
    let reported = topology.link(0, 1).expect("link 0 -> 1").can_access_peer;
    b.bind()?;
    // SAFETY: `a` is a retained context; flags must be 0.
    let enabled = unsafe { cuda_sys::driver!(cuCtxEnablePeerAccess(a.raw(), 0)) };
    let works = match &enabled {
        Ok(()) => true,
        Err(error) => error.code() == Some(cuda_sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED),
    };
    ensure!(works == reported, "the topology said peer access {reported}, enabling it gave {enabled:?}");
    Ok(())
}

fn peer_copy_between_two_gpus() -> Result<()> {
    let (context0, stream0, kernels0) = setup()?;
    let context1 = Context::on_ordinal(1)?;
    let stream1 = Stream::new(&context1)?;
    let kernels1 = Kernels::get(&context1)?;
    let len = 256 << 20;
    let source = DeviceBuffer::alloc(&context0, len)?;
    let target = DeviceBuffer::alloc(&context1, len)?;
    kernels0.fill(&source, 0, len, 41, &stream0)?;
    stream0.synchronize()?;
    context1.enable_peer_access(&context0)?;
    copy_peer_async(&target, &source, len, &stream1)?; // warm-up
    stream1.synchronize()?;
    target.memset_async(0, &stream1)?;
    stream1.synchronize()?;
    let start = std::time::Instant::now();
    copy_peer_async(&target, &source, len, &stream1)?;
    stream1.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    let sum = kernels1.checksum(&target, 0, len, &stream1)?;
    ensure!(sum == reference::checksum(&reference::pattern(len, 41)), "GPU1 holds other bytes");
    println!(
        "peer copy GPU0 -> GPU1: {len} bytes at {:.0} GB/s (one copy after a warm-up)",
        len as f64 / seconds / 1e9
    );
    Ok(())
}
