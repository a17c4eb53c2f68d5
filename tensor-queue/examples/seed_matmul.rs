//! Seed 1: the producer runs 50 matrix multiplications on `x` and sends `x` at once, without
//! synchronising; the consumer's first use of `x` is ordered after them, and its result matches
//! a reference. With no GPU, the same hand-off runs with host tensors.
//!
//! `cargo run --release -p tensor-queue --example seed_matmul`

use std::process::Command;

use ipc_core::{Context, DeviceBuffer, DeviceMemory, Stream};
use kernels::{Kernels, reference};
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Tensor, TensorDevice, from_parent, spawn};

/// The seed's message: `queue.put(Box(x))`.
#[derive(Serialize, Deserialize)]
struct Box {
    x: Tensor,
}

const STEPS: usize = 50;

type Fallible = Result<(), std::boxed::Box<dyn std::error::Error>>;

fn main() -> Fallible {
    if tensor_queue::is_spawned_child() {
        return consumer();
    }
    let gpu = tensor_queue::is_gpu_available();
    // Large enough that the 50 products take far longer than a hand-off (about a second).
    let n: u64 = if gpu { 4096 } else { 96 };
    let mut child = Command::new(std::env::current_exe()?);
    let (mut child, sender) = spawn::<Box>(&mut child)?;
    let x0 = initial(n);
    if gpu {
        let context = Context::on_ordinal(0)?;
        let stream = Stream::new(&context)?;
        let kernels = Kernels::get(&context)?;
        let x = Tensor::empty_cuda(&context, DType::F32, &[n, n])?;
        let (a, tmp) = (DeviceBuffer::alloc(&context, x.nbytes())?, DeviceBuffer::alloc(&context, x.nbytes())?);
        a.copy_from_host(0, bytemuck::cast_slice(&shift_matrix(n)))?;
        let xv = x.cuda_view()?;
        xv.copy_from_host(0, bytemuck::cast_slice(&x0))?;
        let dims = (n as u32, n as u32, n as u32);
        for step in 0..STEPS {
            // x -> tmp -> x ...: after an even number of steps the result is back in x.
            let (from, to): (&dyn DeviceMemory, &dyn DeviceMemory) =
                if step % 2 == 0 { (&xv, &tmp) } else { (&tmp, &xv) };
            kernels.matmul_f32(&a, from, to, dims, &stream)?;
        }
        sender.send_on(&Box { x }, &stream)?; // no synchronisation: the consumer is ordered on the GPU
        println!("producer: queued {STEPS} matmuls of {n}x{n} on GPU 0 and sent x at once");
        drop(sender);
        stream.synchronize()?;
        drop((a, tmp));
    } else {
        let mut x = x0;
        let a = shift_matrix(n);
        for _ in 0..STEPS {
            x = cpu_matmul(&a, &x, n as usize);
        }
        sender.send(&Box { x: Tensor::from_slice(&x, DType::F32, &[n, n])? })?;
        println!("producer: no GPU here; ran {STEPS} matmuls of {n}x{n} on the CPU and sent x as a host tensor");
        drop(sender);
    }
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the consumer failed ({status})").into());
    }
    Ok(())
}

fn consumer() -> Fallible {
    // A ready consumer: GPU context and kernels loaded before anything arrives.
    if tensor_queue::is_gpu_available() {
        Kernels::get(&Context::on_ordinal(0)?)?;
    }
    let mut receiver = from_parent::<Box>()?;
    let Box { x } = receiver.recv()?;
    let n = x.shape()[0];
    let expected = reference::checksum(bytemuck::cast_slice(&expected(n)));
    let seen = match x.device() {
        TensorDevice::Host => reference::checksum(&x.to_bytes()?),
        TensorDevice::Cuda(_) => {
            let view = x.cuda_view()?;
            let stream = x.stream().ok_or("a received GPU tensor has a stream")?;
            Kernels::get(view.context())?.checksum(&view, 0, x.nbytes(), stream)?
        }
    };
    if seen != expected {
        println!("consumer: MISMATCH: x arrived by {:?} but does not hold the result of all {STEPS} matmuls", x.path());
        std::process::exit(1);
    }
    println!("consumer: x ({n}x{n} f32) arrived by {:?} and matches the reference", x.path());
    Ok(())
}

/// `x0[i][j] = (i * 7 + j) % 13`: small integers, exact in f32 through any permutation.
fn initial(n: u64) -> Vec<f32> {
    (0..n * n).map(|k| ((k / n * 7 + k % n) % 13) as f32).collect()
}

/// `a[i][j] = 1` where `j = i + 1 (mod n)`: `a * x` moves every row of `x` up by one.
fn shift_matrix(n: u64) -> Vec<f32> {
    (0..n * n).map(|k| if k % n == (k / n + 1) % n { 1.0 } else { 0.0 }).collect()
}

/// `a^50 * x0`: row `i` is row `(i + 50) mod n` of `x0`.
fn expected(n: u64) -> Vec<f32> {
    let x0 = initial(n);
    (0..n * n).map(|k| x0[(((k / n + STEPS as u64) % n) * n + k % n) as usize]).collect()
}

fn cpu_matmul(a: &[f32], b: &[f32], n: usize) -> Vec<f32> {
    let mut c = vec![0.0; n * n];
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            if aik != 0.0 {
                for j in 0..n {
                    c[i * n + j] += aik * b[k * n + j];
                }
            }
        }
    }
    c
}
