//! The second process of `tests/tests/outside_inline_gpu.rs`, written as a user outside the
//! workspace would: only `tensor_queue`'s public API (and serde). It sends small GPU messages
//! across "hosts" (a TCP channel), where they travel inline, without NCCL.
//!
//! `outside-inline-peer --to tcp://HOST:PORT [--up-to BYTES] [--route-only]`: connects (the
//! secret from `TQ_SECRET`; the threshold with `SenderBuilder::inline_gpu_up_to` when given),
//! prints `route-4k <Route> <reason|->` (what `Sender::route_for` says of a 4 KiB message from
//! GPU 0; with `--route-only`, then `done` and nothing sent), then sends, from GPU 0 with `send_on`, [`Small`] messages: `i` = 0..4, each a 4 KiB u8
//! tensor of the pattern `(k * 7 + i) % 251`, a `[16, 32]` f32 tensor `k + i` sent as its
//! transpose, and a 4-byte i32 tensor of `i`; prints `sent i` each; then `released` (or
//! `unreleased`) and `done`. Errors: `error <Debug>` and exit status 1.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tensor_queue::{Context, DType, Sender, Stream, Tensor};

/// One message.
#[derive(Serialize, Deserialize)]
pub struct Small {
    /// Its number.
    pub i: u64,
    /// The GPU tensors: 4 KiB of u8, a transposed `[16, 32]` f32 view, one i32.
    pub tensors: Vec<Tensor>,
}

/// The u8 pattern of message `i`.
pub fn bytes_of(i: u64) -> Vec<u8> {
    (0..4096u64).map(|k| ((k * 7 + i) % 251) as u8).collect()
}

/// The f32 matrix of message `i`, row-major `[16, 32]`.
pub fn matrix_of(i: u64) -> Vec<f32> {
    (0..512u64).map(|k| (k + i) as f32).collect()
}

fn main() {
    if let Err(error) = run() {
        println!("error {error:?}");
        std::process::exit(1);
    }
}

fn run() -> tensor_queue::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let to = value("--to").ok_or_else(|| tensor_queue::Error::Invalid("--to tcp://HOST:PORT".into()))?;
    let mut builder = Sender::<Small>::builder();
    if let Some(bytes) = value("--up-to") {
        let bytes = bytes.parse().map_err(|_| tensor_queue::Error::Invalid(format!("--up-to {bytes}")))?;
        builder = builder.inline_gpu_up_to(bytes);
    }
    let sender = builder.connect(to.as_str())?;
    let stream = Stream::new(&Context::on_ordinal(0)?)?;
    let gpu = stream.context().device().uuid()?;
    let choice = sender.route_for(&gpu, 4096, Duration::from_secs(30))?;
    println!("route-4k {:?} {}", choice.route, choice.reason.as_deref().unwrap_or("-"));
    if args.iter().any(|a| a == "--route-only") {
        println!("done");
        return Ok(());
    }
    for i in 0..4 {
        let bytes = Tensor::from_slice_cuda(&bytes_of(i), DType::U8, &[4096], &stream)?;
        let matrix = Tensor::from_slice_cuda(&matrix_of(i), DType::F32, &[16, 32], &stream)?.transpose(0, 1)?;
        let one = Tensor::from_slice_cuda(&[i as i32], DType::I32, &[1], &stream)?;
        sender.send_on(&Small { i, tensors: vec![bytes, matrix, one] }, &stream)?;
        println!("sent {i}");
    }
    if sender.wait_released(Duration::from_secs(30)) {
        println!("released");
    } else {
        println!("unreleased {}", sender.outstanding_leases());
    }
    println!("done");
    Ok(())
}
