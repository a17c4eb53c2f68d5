//! The tensor API on the GPU, as a user outside the workspace calls it: making, filling, copying
//! and reading GPU tensors, ordering after a received tensor's stream, and `record_stream`. Data
//! is checked with checksums computed on the GPU against `kernels::reference`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use integration_tests::{GpuTest, run_gpu_tests, socket_path};
use ipc_core::DeviceBuffer;
use kernels::{Kernels, reference};
use tensor_queue::{Context, DType, DeviceMemory, Receiver, Sender, Stream, Tensor};

fn main() {
    run_gpu_tests(vec![
        GpuTest { name: "gpu_tensors_are_made_filled_and_read_back", gpus: 1, run: made_filled_read },
        GpuTest { name: "strided_gpu_views_are_copied_by_the_pack_kernels", gpus: 1, run: strided_copies },
        GpuTest { name: "a_received_gpu_tensor_is_copied_and_forwarded", gpus: 1, run: forwarded },
        GpuTest { name: "record_stream_keeps_memory_from_the_sender_until_other_work_is_done", gpus: 1, run: recorded },
        GpuTest { name: "without_record_stream_the_sender_rewrites_memory_still_read", gpus: 1, run: unrecorded },
    ]);
}

fn gpu() -> Result<(Arc<Context>, Stream)> {
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    Ok((context, stream))
}

/// The checksum of a contiguous GPU tensor's bytes, computed on the GPU on `stream`.
fn gpu_checksum(tensor: &Tensor, stream: &Stream) -> Result<u64> {
    ensure!(tensor.is_contiguous(), "a contiguous tensor");
    let view = tensor.cuda_view()?;
    Ok(Kernels::get(view.context())?.checksum(&view, 0, tensor.nbytes(), stream)?)
}

fn made_filled_read() -> Result<()> {
    let (_context, stream) = gpu()?;
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25).collect();
    let x = Tensor::from_slice_cuda(&data, DType::F32, &[10, 100], &stream)?;
    ensure!(x.to_vec::<f32>()? == data, "from_slice_cuda then to_vec");
    let bytes = reference::pattern(4096, 7);
    let y = Tensor::from_bytes_cuda(&bytes, DType::U8, &[4096], &stream)?;
    ensure!(gpu_checksum(&y, &stream)? == reference::checksum(&bytes), "the GPU sees the host's bytes");
    let z = Tensor::zeros_cuda(DType::F64, &[333], &stream)?;
    ensure!(z.to_vec::<f64>()?.iter().all(|&v| v == 0.0), "zeros");
    // Every element size the fill supports, checked on the GPU against the host's picture.
    z.fill_on(-1.5f64, &stream)?;
    let expect: Vec<u8> = (0..333).flat_map(|_| (-1.5f64).to_le_bytes()).collect();
    ensure!(gpu_checksum(&z, &stream)? == reference::checksum(&expect), "an 8-byte fill");
    let h = Tensor::zeros_cuda(DType::I16, &[77], &stream)?;
    h.fill_on(-3i16, &stream)?;
    ensure!(h.to_vec::<i16>()? == vec![-3i16; 77], "a 2-byte fill");
    let b = Tensor::zeros_cuda(DType::U8, &[5], &stream)?;
    b.fill_on(9u8, &stream)?;
    ensure!(b.to_vec::<u8>()? == vec![9u8; 5], "a 1-byte fill");
    let copy = x.copy_to_host_async(&stream)?;
    let back: Vec<f32> = bytemuck::pod_collect_to_vec(&copy.wait()?);
    ensure!(back == data, "copy_to_host_async");
    ensure!(x.fill_on(1u8, &stream).is_err(), "the element type must match");
    Ok(())
}

fn strided_copies() -> Result<()> {
    let (_context, stream) = gpu()?;
    let data: Vec<i32> = (0..24).collect();
    let host = Tensor::from_slice(&data, DType::I32, &[2, 3, 4])?;
    let gpu = Tensor::from_slice_cuda(&data, DType::I32, &[2, 3, 4], &stream)?;
    // Strided views of the same shape on both sides read the same elements in the same order.
    let pairs = [
        (host.transpose(0, 2)?, gpu.transpose(0, 2)?),
        (host.narrow(2, 1, 2)?, gpu.narrow(2, 1, 2)?),
        (host.transpose(1, 2)?.narrow(0, 1, 1)?, gpu.transpose(1, 2)?.narrow(0, 1, 1)?),
    ];
    for (h, g) in &pairs {
        let expected = h.to_bytes()?;
        ensure!(g.to_bytes()? == expected, "to_bytes of a strided GPU view");
        let packed = g.contiguous_on(&stream)?;
        ensure!(packed.is_contiguous() && gpu_checksum(&packed, &stream)? == reference::checksum(&expected));
        // Into a strided destination: a transposed view of a fresh tensor of the transposed shape.
        let mut shape = g.shape().to_vec();
        shape.swap(0, 1);
        let target = Tensor::zeros_cuda(DType::I32, &shape, &stream)?;
        let view = target.transpose(0, 1)?;
        g.copy_into_on(&view, &stream)?;
        ensure!(view.to_bytes()? == expected, "copy_into a strided view");
    }
    // Filling a strided view writes only its elements.
    let base = Tensor::zeros_cuda(DType::I32, &[4, 4], &stream)?;
    base.narrow(1, 1, 2)?.fill_on(5i32, &stream)?;
    let row = [0, 5, 5, 0];
    ensure!(base.to_vec::<i32>()? == row.repeat(4), "a strided fill");
    Ok(())
}

/// A stage that receives a GPU tensor, copies it, and sends the copy on: the next stage sees the
/// bytes, and the original's lease goes back when the stage drops it.
fn forwarded() -> Result<()> {
    let (context, stream) = gpu()?;
    let kernels = Kernels::get(&context)?;
    let (first, second) = (socket_path("first"), socket_path("second"));
    let mut stage = Receiver::<Tensor>::bind(&first)?;
    let mut last = Receiver::<Tensor>::bind(&second)?;
    let to_stage = Sender::<Tensor>::connect(&first)?;
    let onward = Sender::<Tensor>::connect(&second)?;
    let original = Tensor::empty_cuda(&context, DType::U8, &[1 << 20])?;
    kernels.fill(&original.cuda_view()?, 0, 1 << 20, 42, &stream)?;
    to_stage.send_on(&original, &stream)?;
    let received = stage.recv_timeout(Duration::from_secs(10))?;
    ensure!(matches!(onward.send(&received), Err(tensor_queue::Error::NotSendable(_))), "as it is, it is refused");
    let mine = Stream::new(&context)?;
    let copy = received.copy_on(&mine)?;
    onward.send_on(&copy, &mine)?;
    drop(received);
    let arrived = last.recv_timeout(Duration::from_secs(10))?;
    let checked = gpu_checksum(&arrived, arrived.stream().expect("a received GPU tensor has a stream"))?;
    ensure!(checked == reference::checksum(&reference::pattern(1 << 20, 42)), "the last stage sees the bytes");
    ensure!(to_stage.wait_released(Duration::from_secs(10)), "the original comes back");
    Ok(())
}

/// Sends one tensor to a receiver in this process; the receiver reads it on a stream of its own
/// after a long spin and drops it at once (recording the stream or not); the sender then reuses
/// the memory as soon as it is released. Whether the read saw the original bytes.
fn read_while_sender_reuses(record: bool) -> Result<bool> {
    let (context, stream) = gpu()?;
    let kernels = Kernels::get(&context)?;
    let path = socket_path(if record { "recorded" } else { "unrecorded" });
    let mut receiver = Receiver::<Tensor>::bind(&path)?;
    let sender = Sender::<Tensor>::connect(&path)?;
    let len = 1 << 16;
    let sent = Tensor::empty_cuda(&context, DType::U8, &[len as u64])?;
    kernels.fill(&sent.cuda_view()?, 0, len, 1, &stream)?;
    sender.send_on(&sent, &stream)?;
    drop(sent);
    let received = receiver.recv_timeout(Duration::from_secs(10))?;
    let other = Stream::new(&context)?;
    let ready = ipc_core::Event::new(&context)?;
    ready.record(received.stream().expect("a stream"))?;
    other.wait_event(&ready)?;
    let scratch = DeviceBuffer::alloc(&context, 1 << 12)?;
    kernels.spin_then_fill(&scratch, 1 << 12, 0, Duration::from_millis(300), &other)?;
    let counter = DeviceBuffer::alloc(&context, 8)?;
    counter.memset_async(0, &other)?;
    kernels.read(&received.cuda_view()?, 0, len, &counter, &other)?;
    if record {
        received.record_stream(&other)?;
    }
    drop(received);
    let start = Instant::now();
    ensure!(sender.wait_released(Duration::from_secs(10)), "the lease comes back");
    let released_after = start.elapsed();
    // The sender reuses the memory at once: the same size from the same arena, new bytes.
    let reused = Tensor::empty_cuda(&context, DType::U8, &[len as u64])?;
    kernels.fill(&reused.cuda_view()?, 0, len, 2, &stream)?;
    stream.synchronize()?;
    other.synchronize()?;
    let mut sum = [0u8; 8];
    counter.copy_to_host(0, &mut sum)?;
    let seen = u64::from_le_bytes(sum);
    println!(
        "record_stream {record}: lease back after {released_after:?}; the read saw the original: {}",
        seen == reference::word_sum(&reference::pattern(len, 1))
    );
    Ok(seen == reference::word_sum(&reference::pattern(len, 1)))
}

fn recorded() -> Result<()> {
    ensure!(read_while_sender_reuses(true)?, "with record_stream the read must see the sender's original bytes");
    Ok(())
}

/// The negative control: it must fail without `record_stream`, or the positive test proves nothing.
fn unrecorded() -> Result<()> {
    ensure!(!read_while_sender_reuses(false)?, "without record_stream the sender's reuse should have raced the read");
    Ok(())
}
