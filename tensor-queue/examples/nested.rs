//! Seed 2: a nested message with several tensors on one device and plain fields. Tensors sit in
//! a struct inside a struct, in an `Option`, in a map and in a `Vec`; the consumer checks every one.
//!
//! `cargo run --release -p tensor-queue --example nested`

use std::collections::BTreeMap;
use std::process::Command;

use ipc_core::{Context, DeviceMemory, Stream};
use kernels::{Kernels, reference};
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Tensor, TensorDevice, from_parent, spawn};

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error>>;

#[derive(Serialize, Deserialize)]
struct Inputs {
    image: Tensor,
    mask: Option<Tensor>,
    extras: BTreeMap<String, Tensor>,
}

#[derive(Serialize, Deserialize)]
struct Batch {
    inputs: Inputs,
    labels: Vec<Tensor>,
    step: u64,
    source: String,
}

fn main() -> Fallible {
    if tensor_queue::is_spawned_child() {
        return consumer();
    }
    let gpu = tensor_queue::is_gpu_available().then(|| -> Fallible<_> {
        let context = Context::on_ordinal(0)?;
        let stream = Stream::new(&context)?;
        Ok((context, stream))
    });
    let gpu = gpu.transpose()?;
    // A tensor of `shape` bytes holding the pattern of `seed`, made on the GPU when there is one.
    let make = |seed: u64, shape: &[u64]| -> Fallible<Tensor> {
        let len = shape.iter().product::<u64>() as usize;
        Ok(match &gpu {
            Some((context, stream)) => {
                let tensor = Tensor::empty_cuda(context, DType::U8, shape)?;
                Kernels::get(context)?.fill(&tensor.cuda_view()?, 0, len, seed, stream)?;
                tensor
            }
            None => Tensor::from_bytes(&reference::pattern(len, seed), DType::U8, shape)?,
        })
    };
    let (mut child, sender) = spawn::<Batch>(&mut Command::new(std::env::current_exe()?))?;
    for step in 0..3u64 {
        let seed = step * 10;
        let batch = Batch {
            inputs: Inputs {
                image: make(seed + 1, &[3, 224, 224])?,
                mask: (step % 2 == 0).then(|| make(seed + 2, &[224, 224])).transpose()?,
                extras: BTreeMap::from([("depth".to_string(), make(seed + 3, &[224, 224])?)]),
            },
            labels: vec![make(seed + 4, &[16])?, make(seed + 5, &[16])?],
            step,
            source: format!("shard-{step}"),
        };
        match &gpu {
            Some((_, stream)) => sender.send_on(&batch, stream)?,
            None => sender.send(&batch)?,
        }
    }
    drop(sender);
    if !child.wait()?.success() {
        return Err("the consumer failed".into());
    }
    Ok(())
}

fn check(name: &str, tensor: &Tensor, seed: u64) -> Fallible {
    let len = tensor.nbytes();
    let seen = match tensor.device() {
        TensorDevice::Host => reference::checksum(&tensor.to_bytes()?),
        TensorDevice::Cuda(_) => {
            let view = tensor.cuda_view()?;
            Kernels::get(view.context())?.checksum(&view, 0, len, tensor.stream().ok_or("no stream")?)?
        }
    };
    if seen != reference::checksum(&reference::pattern(len, seed)) {
        return Err(format!("{name}: other bytes than were sent").into());
    }
    println!("  {name:<14} {:?} {:?} via {:?}: ok", tensor.dtype(), tensor.shape(), tensor.path());
    Ok(())
}

fn consumer() -> Fallible {
    let mut receiver = from_parent::<Batch>()?;
    for _ in 0..3 {
        let batch = receiver.recv()?;
        let seed = batch.step * 10;
        println!("consumer: step {} from {}", batch.step, batch.source);
        check("inputs.image", &batch.inputs.image, seed + 1)?;
        match &batch.inputs.mask {
            Some(mask) => check("inputs.mask", mask, seed + 2)?,
            None => println!("  inputs.mask    None"),
        }
        check("extras[depth]", &batch.inputs.extras["depth"], seed + 3)?;
        for (i, label) in batch.labels.iter().enumerate() {
            check(&format!("labels[{i}]"), label, seed + 4 + i as u64)?;
        }
    }
    Ok(())
}
