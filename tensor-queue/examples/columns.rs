//! Seed 3: many worker processes each write their own column of one shared tensor; the parent
//! sees every column once all report done. The tensor is shared, not copied: on the GPU the
//! workers map the parent's memory; without a GPU they map its shared memory.
//!
//! `cargo run --release -p tensor-queue --example columns`

use std::process::Command;

use ipc_core::{Context, DeviceBuffer, DeviceMemory, Stream};
use kernels::{Kernels, StridedLayout, reference};
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Receiver, Sender, Tensor, TensorDevice, from_parent, spawn};

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error>>;

const ROWS: u64 = 512;
const WORKERS: u64 = 8;

#[derive(Serialize, Deserialize)]
struct Work {
    matrix: Tensor,
    column: u64,
    report_to: String,
}

#[derive(Serialize, Deserialize)]
struct Done {
    column: u64,
}

/// The value worker `column` writes in `row`.
fn value(row: u64, column: u64) -> f32 {
    (row * 100 + column) as f32
}

fn main() -> Fallible {
    if tensor_queue::is_spawned_child() {
        return worker();
    }
    let report_path = std::env::temp_dir().join(format!("columns-{}.sock", std::process::id()));
    let mut done = Receiver::<Done>::bind(&report_path)?;
    let gpu = tensor_queue::is_gpu_available();
    let context = if gpu { Some(Context::on_ordinal(0)?) } else { None };
    let matrix = match &context {
        Some(context) => {
            let matrix = Tensor::empty_cuda(context, DType::F32, &[ROWS, WORKERS])?;
            matrix.cuda_view()?.copy_from_host(0, &vec![0u8; matrix.nbytes()])?;
            matrix
        }
        // Shared writable on purpose: the workers write their columns into it.
        None => Tensor::zeros_writable(DType::F32, &[ROWS, WORKERS])?,
    };
    let mut children = Vec::new();
    for column in 0..WORKERS {
        let (child, sender) = spawn::<Work>(&mut Command::new(std::env::current_exe()?))?;
        let report_to = report_path.to_string_lossy().into_owned();
        sender.send(&Work { matrix: matrix.clone(), column, report_to })?;
        children.push((child, sender));
    }
    for _ in 0..WORKERS {
        let Done { column } = done.recv()?;
        println!("parent: worker {column} reports its column written");
    }
    let expected: Vec<f32> = (0..ROWS * WORKERS).map(|k| value(k / WORKERS, k % WORKERS)).collect();
    let expected_sum = reference::checksum(bytemuck::cast_slice(&expected));
    let seen = match &context {
        Some(context) => {
            let stream = Stream::new(context)?;
            Kernels::get(context)?.checksum(&matrix.cuda_view()?, 0, matrix.nbytes(), &stream)?
        }
        None => reference::checksum(&matrix.to_bytes()?),
    };
    if seen != expected_sum {
        return Err("the parent does not see every column".into());
    }
    println!("parent: all {WORKERS} columns of the {ROWS}x{WORKERS} {:?} matrix are in place", matrix.device());
    for (mut child, sender) in children {
        drop(sender);
        child.wait()?;
    }
    Ok(())
}

fn worker() -> Fallible {
    let mut work = from_parent::<Work>()?;
    let Work { matrix, column, report_to } = work.recv()?;
    let column_view = matrix.narrow(1, column, 1)?; // a strided view: stride WORKERS elements
    let values: Vec<f32> = (0..ROWS).map(|row| value(row, column)).collect();
    match matrix.device() {
        TensorDevice::Cuda(_) => {
            let view = column_view.cuda_view()?;
            let stream = matrix.stream().ok_or("a received GPU tensor has a stream")?;
            let staging = DeviceBuffer::alloc(view.context(), values.len() * 4)?;
            staging.copy_from_host(0, bytemuck::cast_slice(&values))?;
            let layout = StridedLayout::new(column_view.shape(), column_view.strides(), 4)?;
            Kernels::get(view.context())?.unpack(&staging, 0, &layout, &view, 0, stream)?;
            stream.synchronize()?;
        }
        TensorDevice::Host => {
            for (row, value) in values.into_iter().enumerate() {
                column_view.set(&[row as u64, 0], value)?;
            }
        }
    }
    let report = Sender::<Done>::connect(&report_to)?;
    report.send(&Done { column })?;
    // Stay until the parent dismisses us (closes the work channel).
    while work.recv().is_ok() {}
    Ok(())
}
