//! The README's demo: a parent and a child process hand tensors to each other through
//! tensor-queue, on the GPU where there is one and with host tensors where there is none, and
//! print what went where and how long it took.
//!
//! `cargo xtask demo` (or `cargo run --release -p tensor-queue --example demo`)

use std::process::Command;
use std::time::Instant;

use ipc_core::{Context, DeviceMemory, Stream};
use kernels::{Kernels, reference};
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Receiver, Sender, Tensor, TensorDevice, from_parent, spawn};

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error>>;

const REPLY_ENV: &str = "DEMO_REPLY";
const ROUND_TRIPS: usize = 2000;

#[derive(Serialize, Deserialize)]
struct Request {
    id: u64,
    small: Tensor,
    large: Option<Tensor>,
    label: String,
}

#[derive(Serialize, Deserialize)]
struct Reply {
    id: u64,
    report: Option<String>,
}

fn main() -> Fallible {
    if let Some(reply) = std::env::var_os(REPLY_ENV) {
        return child(&reply);
    }
    let reply_path = std::env::temp_dir().join(format!("demo-{}.sock", std::process::id()));
    let mut replies = Receiver::<Reply>::bind(&reply_path)?;
    let gpu = if tensor_queue::is_gpu_available() {
        let context = Context::on_ordinal(0)?;
        let stream = Stream::new(&context)?;
        println!("demo: GPU 0 is {} ({})", context.device().name()?, context.device().uuid()?);
        Some((context, stream))
    } else {
        println!(
            "demo: no GPU here ({}); using host tensors",
            ipc_core::driver_info::driver_version().err().map(|e| e.to_string()).unwrap_or_default()
        );
        None
    };
    let make = |len: usize, seed: u64| -> Fallible<Tensor> {
        Ok(match &gpu {
            Some((context, stream)) => {
                let tensor = Tensor::empty_cuda(context, DType::U8, &[len as u64])?;
                Kernels::get(context)?.fill(&tensor.cuda_view()?, 0, len, seed, stream)?;
                tensor
            }
            None => Tensor::from_bytes(&reference::pattern(len, seed), DType::U8, &[len as u64])?,
        })
    };
    let send = |sender: &Sender<Request>, request: &Request| match &gpu {
        Some((_, stream)) => sender.send_on(request, stream),
        None => sender.send(request),
    };

    let start = Instant::now();
    let mut command = Command::new(std::env::current_exe()?);
    command.env(REPLY_ENV, &reply_path);
    let (mut child, sender) = spawn::<Request>(&mut command)?;
    let request = Request { id: 0, small: make(4096, 1)?, large: Some(make(64 << 20, 2)?), label: "first".into() };
    send(&sender, &request)?;
    let first = replies.recv()?;
    println!(
        "demo: child {} started; first message answered after {:.1} ms (spawn, connect, export, import)",
        child.id(),
        start.elapsed().as_secs_f64() * 1e3
    );
    println!("{}", first.report.unwrap_or_default());

    let small = make(4096, 3)?;
    let mut round_trips = Vec::with_capacity(ROUND_TRIPS);
    for id in 1..=ROUND_TRIPS as u64 + 200 {
        let begin = Instant::now();
        send(&sender, &Request { id, small: small.clone(), large: None, label: String::new() })?;
        let reply = replies.recv()?;
        if reply.id != id {
            return Err(format!("reply {} to request {id}", reply.id).into());
        }
        if id > 200 {
            round_trips.push(begin.elapsed().as_nanos() as u64); // after 200 warm-up trips
        }
    }
    round_trips.sort_unstable();
    let at = |p: f64| round_trips[((round_trips.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
    println!(
        "demo: {ROUND_TRIPS} round trips of a message with one 4 KB {} tensor: p50 {:.1} us, p99 {:.1} us",
        if gpu.is_some() { "GPU" } else { "host" },
        at(0.5),
        at(0.99)
    );
    let wait = Instant::now();
    while sender.outstanding_leases() > 0 && wait.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    println!("demo: leases the child still holds: {} (all come back by themselves)", sender.outstanding_leases());
    drop(sender);
    child.wait()?;
    Ok(())
}

fn child(reply_path: &std::ffi::OsStr) -> Fallible {
    let mut requests = from_parent::<Request>()?;
    let replies = Sender::<Reply>::connect(reply_path)?;
    while let Ok(request) = requests.recv() {
        let report = if request.id == 0 { Some(describe(&request)?) } else { None };
        replies.send(&Reply { id: request.id, report })?;
    }
    Ok(())
}

/// What went where: each tensor's device, path and a checksum made where it landed.
fn describe(request: &Request) -> Fallible<String> {
    let mut lines = Vec::new();
    for (name, tensor, seed) in [("small", Some(&request.small), 1), ("large", request.large.as_ref(), 2)] {
        let Some(tensor) = tensor else { continue };
        let len = tensor.nbytes();
        let sum = match tensor.device() {
            TensorDevice::Host => reference::checksum(&tensor.to_bytes()?),
            TensorDevice::Cuda(_) => {
                let view = tensor.cuda_view()?;
                Kernels::get(view.context())?.checksum(&view, 0, len, tensor.stream().ok_or("no stream")?)?
            }
        };
        let verdict =
            if sum == reference::checksum(&reference::pattern(len, seed)) { "bytes match" } else { "BYTES DIFFER" };
        lines.push(format!(
            "  child got {name}: {len} bytes on {:?}, via {:?} (zero-copy), {verdict}",
            tensor.device(),
            tensor.path()
        ));
    }
    Ok(lines.join("\n"))
}
