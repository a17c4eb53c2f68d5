//! The async API under tokio: a producer process sends batches, the parent reads them as a
//! `Stream` on a multi-threaded runtime, and forwards a summary of each to a consumer process with
//! `send_async`. No thread blocks: every wait goes through tokio's reactor.
//!
//! `cargo run -p tensor-queue --features tokio --example async_pipeline`

use std::process::Command;

use futures_core::Stream;
use tensor_queue::{DType, Receiver, Sender, Tensor, from_parent, spawn};

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const BATCHES: u32 = 8;

fn main() -> Fallible {
    match std::env::args().nth(1).as_deref() {
        Some("produce") => produce(&std::env::args().nth(2).ok_or("produce <path>")?),
        Some("consume") => consume(),
        _ => tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(forward()),
    }
}

async fn forward() -> Fallible {
    let path = std::env::temp_dir().join(format!("async-pipeline-{}.sock", std::process::id()));
    let mut batches = Receiver::<Tensor>::bind(&path)?;
    batches.expect_senders(1);
    let mut producer = Command::new(std::env::current_exe()?).arg("produce").arg(&path).spawn()?;
    let (mut consumer, sums) = spawn::<f32>(Command::new(std::env::current_exe()?).arg("consume"))?;
    // `StreamExt::next` from futures or tokio-stream reads better; this example keeps to futures-core.
    while let Some(batch) = std::future::poll_fn(|cx| std::pin::Pin::new(&mut batches).poll_next(cx)).await {
        let batch = batch?;
        let sum: f32 = batch.to_vec::<f32>()?.iter().sum();
        sums.send_async(&sum).await?; // waits for the consumer's credit without blocking a thread
    }
    drop(sums);
    producer.wait()?;
    consumer.wait()?;
    Ok(())
}

fn produce(path: &str) -> Fallible {
    let sender = Sender::<Tensor>::connect(path)?;
    for i in 0..BATCHES {
        sender.send(&Tensor::from_slice(&[i as f32; 4], DType::F32, &[4])?)?;
    }
    Ok(())
}

fn consume() -> Fallible {
    let mut sums = from_parent::<f32>()?;
    for sum in &mut sums {
        println!("consumer: batch sum {}", sum?);
    }
    println!("consumer: the producer's stream ended");
    Ok(())
}
