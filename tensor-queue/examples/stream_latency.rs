//! Seed 4: a producer streams freshly allocated 5 MB tensors to a consumer, which prints the
//! latency from the send call to the data being usable on its GPU, broken into stages. Every
//! stage is measured on the machine's monotonic clock, which both processes share.
//!
//! `cargo run --release -p tensor-queue --example stream_latency [items]`

use std::process::Command;

use ipc_core::{Context, DeviceMemory, Stream};
use kernels::{Kernels, reference};
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Tensor, TensorDevice, from_parent, monotonic_ns, spawn};

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error>>;

const BYTES: u64 = 5 << 20;

#[derive(Serialize, Deserialize)]
struct Item {
    tensor: Tensor,
    seq: u64,
}

fn main() -> Fallible {
    let items: u64 = std::env::args().nth(1).map(|n| n.parse()).transpose()?.unwrap_or(2000);
    if tensor_queue::is_spawned_child() {
        return consumer(items);
    }
    let mut command = Command::new(std::env::current_exe()?);
    command.arg(items.to_string());
    let (mut child, sender) = spawn::<Item>(&mut command)?;
    if tensor_queue::is_gpu_available() {
        let context = Context::on_ordinal(0)?;
        let stream = Stream::new(&context)?;
        let kernels = Kernels::get(&context)?;
        for seq in 0..items {
            let tensor = Tensor::empty_cuda(&context, DType::U8, &[BYTES])?;
            kernels.fill(&tensor.cuda_view()?, 0, BYTES as usize, seq, &stream)?;
            sender.send_on(&Item { tensor, seq }, &stream)?;
        }
    } else {
        for seq in 0..items {
            let tensor = Tensor::zeros(DType::U8, &[BYTES])?;
            tensor.set(&[0], seq as u8)?;
            sender.send(&Item { tensor, seq })?;
        }
    }
    drop(sender);
    if !child.wait()?.success() {
        return Err("the consumer failed".into());
    }
    Ok(())
}

fn consumer(items: u64) -> Fallible {
    let mut receiver = from_parent::<Item>()?;
    let names = ["encode", "socket", "import+order", "queue+decode", "gpu ready", "total"];
    let mut stages: Vec<Vec<u64>> = vec![Vec::new(); names.len()];
    let (mut first_sent, mut last_usable, mut place) = (0, 0, String::new());
    for _ in 0..items {
        let (item, info) = receiver.recv_with_info(None)?;
        let usable = match item.tensor.device() {
            TensorDevice::Cuda(_) => {
                let stream = item.tensor.stream().ok_or("a received GPU tensor has a stream")?;
                if item.seq % 500 == 0 {
                    let view = item.tensor.cuda_view()?;
                    let sum = Kernels::get(view.context())?.checksum(&view, 0, BYTES as usize, stream)?;
                    if sum != reference::checksum(&reference::pattern(BYTES as usize, item.seq)) {
                        return Err(format!("item {} holds other bytes", item.seq).into());
                    }
                }
                stream.synchronize()?; // the data is usable on the GPU from here
                monotonic_ns()
            }
            TensorDevice::Host => {
                if item.tensor.get::<u8>(&[0])? != item.seq as u8 {
                    return Err(format!("item {} holds other bytes", item.seq).into());
                }
                info.decoded_ns
            }
        };
        let marks = [info.sent_ns, info.encoded_ns, info.arrived_ns, info.imported_ns, info.decoded_ns, usable];
        for (stage, pair) in stages.iter_mut().zip(marks.windows(2)) {
            stage.push(pair[1].saturating_sub(pair[0]));
        }
        stages[5].push(usable - info.sent_ns);
        if item.seq == 0 {
            first_sent = info.sent_ns;
            place = format!("{:?} via {:?}", item.tensor.device(), item.tensor.path());
        }
        last_usable = usable;
    }
    let seconds = (last_usable - first_sent) as f64 / 1e9;
    println!("consumer: {items} fresh 5 MB tensors, {place}: {:.0} items/s", items as f64 / seconds);
    println!("{:<14} {:>10} {:>10}", "stage (us)", "p50", "p99");
    for (name, mut values) in names.iter().zip(stages) {
        values.sort_unstable();
        let at = |p: f64| values[((values.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
        println!("{name:<14} {:>10.1} {:>10.1}", at(0.5), at(0.99));
    }
    Ok(())
}
