//! One channel between two hosts: a loader sends batches (GPU images, a strided GPU view, host
//! labels) to a trainer on another machine. The GPU tensors move through NCCL onto the trainer's
//! GPU, ordered after the loader's work on its stream; the host tensors travel over the TCP
//! link. The trainer checks every tensor with a checksum computed on its own GPU.
//!
//! On two machines (the same `TQ_SECRET` on both; `openssl rand -hex 32` makes one):
//! ```text
//! trainer-3$ TQ_SECRET=... two_hosts trainer tcp://0.0.0.0:7000
//! loader-1$  TQ_SECRET=... two_hosts loader tcp://trainer-3:7000
//! ```
//! On one machine, `cargo run --release -p tensor-queue --example two_hosts` runs both: the
//! trainer in a second process on the last GPU, the loader on GPU 0, over `127.0.0.1`. A TCP
//! channel always moves tensors as between hosts, so this is the same path. With one GPU the
//! trainer takes host tensors (NCCL needs a GPU per rank); without a GPU everything is host
//! tensors.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use kernels::{Kernels, reference};
use serde::{Deserialize, Serialize};
use tensor_queue::route::{Landing, Routing};
use tensor_queue::{Context, DType, Device, Receiver, Sender, Stream, Tensor, is_gpu_available};

#[derive(Serialize, Deserialize)]
struct Batch {
    step: u64,
    images: Tensor,
    /// Every other row of the images' first channel: a strided view, sent as it is.
    view: Tensor,
    labels: Tensor,
    /// The loader's checksums of images, view and labels (row-major bytes).
    sums: [u64; 3],
}

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error>>;

const STEPS: u64 = 20;

fn main() -> Fallible {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("trainer") => trainer(args.get(1).map_or("tcp://0.0.0.0:7000", String::as_str), false),
        Some("trainer-host") => trainer(args.get(1).map_or("tcp://0.0.0.0:7000", String::as_str), true),
        Some("loader") => loader(args.get(1).ok_or("loader <tcp://host:port>")?),
        None => both(),
        Some(other) => Err(format!("unknown role {other}: trainer, loader, or nothing for both here").into()),
    }
}

/// Both ends on this machine: the trainer in a child process, the loader here.
fn both() -> Fallible {
    if std::env::var_os("TQ_SECRET").is_none() {
        let mut secret = [0u8; 16];
        std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut secret))?;
        let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        // SAFETY: no other thread runs yet.
        unsafe { std::env::set_var("TQ_SECRET", hex) };
    }
    let gpus = if is_gpu_available() { Device::count()? } else { 0 };
    let mut trainer = Command::new(std::env::current_exe()?);
    trainer.arg(if gpus >= 2 { "trainer" } else { "trainer-host" }).arg("tcp://127.0.0.1:0");
    if gpus >= 2 {
        trainer.env("CUDA_VISIBLE_DEVICES", (gpus - 1).to_string()); // one GPU per process
    }
    let mut child = trainer.stdout(Stdio::piped()).spawn()?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let address = loop {
        let line = lines.next().ok_or("the trainer ended before it listened")??;
        println!("{line}");
        if let Some(address) = line.strip_prefix("trainer: listening on ") {
            break address.to_string();
        }
    };
    loader(&address)?;
    for line in lines {
        println!("{}", line?);
    }
    if !child.wait()?.success() {
        return Err("the trainer failed".into());
    }
    Ok(())
}

fn loader(endpoint: &str) -> Fallible {
    let sender = Sender::<Batch>::connect(endpoint)?;
    let gpu = is_gpu_available() && Device::count()? > 0;
    let stream = if gpu { Some(Stream::new(&Context::on_ordinal(0)?)?) } else { None };
    for step in 0..STEPS {
        let batch = match &stream {
            Some(stream) => gpu_batch(step, stream)?,
            None => host_batch(step)?,
        };
        match &stream {
            Some(stream) => sender.send_on(&batch, stream)?, // returns at once: NCCL sends after the fill
            None => sender.send(&batch)?,
        }
    }
    println!("loader: sent {STEPS} batches to {endpoint} ({})", if gpu { "GPU images" } else { "host tensors" });
    Ok(())
}

fn gpu_batch(step: u64, stream: &Stream) -> Fallible<Batch> {
    let kernels = Kernels::get(stream.context())?;
    let images = Tensor::empty_cuda(stream.context(), DType::F32, &[64, 3, 32, 32])?;
    kernels.fill(&images.cuda_view()?, 0, images.nbytes(), step, stream)?;
    let view = images.select(1, 0)?.slice(1, 0, 32, 2)?;
    let labels = Tensor::from_slice(&(0..64).map(|i| (i + step) as i64).collect::<Vec<_>>(), DType::I64, &[64])?;
    let sums = [gpu_checksum(&images, stream)?, gpu_checksum(&view, stream)?, reference::checksum(&labels.to_bytes()?)];
    Ok(Batch { step, images, view, labels, sums })
}

fn host_batch(step: u64) -> Fallible<Batch> {
    let images = Tensor::from_bytes(&reference::pattern(64 * 3 * 32 * 32 * 4, step), DType::F32, &[64, 3, 32, 32])?;
    let view = images.select(1, 0)?.slice(1, 0, 32, 2)?;
    let labels = Tensor::from_slice(&(0..64).map(|i| (i + step) as i64).collect::<Vec<_>>(), DType::I64, &[64])?;
    let sums = [images.to_bytes()?, view.to_bytes()?, labels.to_bytes()?].map(|b| reference::checksum(&b));
    Ok(Batch { step, images, view, labels, sums })
}

/// The checksum of a tensor's elements in row-major order, computed on the GPU of `stream`.
fn gpu_checksum(tensor: &Tensor, stream: &Stream) -> Fallible<u64> {
    let packed = tensor.contiguous_on(stream)?;
    Ok(Kernels::get(stream.context())?.checksum(&packed.cuda_view()?, 0, packed.nbytes(), stream)?)
}

fn trainer(endpoint: &str, host: bool) -> Fallible {
    let routing = if host || !is_gpu_available() { Routing::default().land(Landing::Host) } else { Routing::default() };
    let mut receiver = Receiver::<Batch>::builder().routing(routing).bind(endpoint)?;
    let address = receiver.local_addr().ok_or("not bound to TCP")?;
    println!("trainer: listening on tcp://{address}");
    let (mut bad, mut paths) = (0, Vec::new());
    for _ in 0..STEPS {
        let batch = receiver.recv()?;
        for (tensor, expected) in [&batch.images, &batch.view, &batch.labels].into_iter().zip(batch.sums) {
            let seen = match tensor.stream() {
                Some(stream) => gpu_checksum(tensor, stream)?, // ordered after the data landed
                None => reference::checksum(&tensor.to_bytes()?),
            };
            bad += usize::from(seen != expected);
            if batch.step == 0 {
                paths.push(format!("{:?}", tensor.path()));
            }
        }
    }
    println!("trainer: {STEPS} batches, paths (images, view, labels) {}, {bad} mismatched", paths.join(", "));
    if bad > 0 {
        std::process::exit(1);
    }
    Ok(())
}
