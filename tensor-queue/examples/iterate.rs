//! Iterating over a receiver and waiting on two at once: worker processes send results to one
//! receiver and progress notes to another; the parent waits on both with `Select`, then reads the
//! rest of the results with a `for` loop that ends when every worker has gone.
//!
//! `cargo run -p tensor-queue --example iterate`

use std::process::Command;

use tensor_queue::channel::Select;
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error>>;

const WORKERS: usize = 3;
const STEPS: u32 = 4;

fn main() -> Fallible {
    let mut args = std::env::args().skip(1);
    if let (Some(results), Some(notes), Some(id)) = (args.next(), args.next(), args.next()) {
        return worker(&results, &notes, id.parse()?);
    }
    let dir = std::env::temp_dir();
    let results_path = dir.join(format!("iterate-results-{}.sock", std::process::id()));
    let notes_path = dir.join(format!("iterate-notes-{}.sock", std::process::id()));
    let mut results = Receiver::<(usize, Tensor)>::bind(&results_path)?;
    let mut notes = Receiver::<String>::bind(&notes_path)?;
    // The iteration ends when all three workers have come and gone, not in a moment between two.
    results.expect_senders(WORKERS);
    notes.expect_senders(WORKERS);
    let mut children = Vec::new();
    for id in 0..WORKERS {
        children.push(
            Command::new(std::env::current_exe()?).arg(&results_path).arg(&notes_path).arg(id.to_string()).spawn()?,
        );
    }

    // Both at once, until the first result is in.
    let mut select = Select::new();
    let (on_results, on_notes) = (select.add(&results)?, select.add(&notes)?);
    let mut sums = vec![0.0f32; WORKERS];
    'waiting: loop {
        let ready = select.ready()?;
        if ready == on_notes {
            for note in notes.try_iter() {
                println!("note: {}", note?);
            }
        } else if ready == on_results {
            match results.try_recv() {
                Ok((id, tensor)) => {
                    sums[id] += tensor.to_vec::<f32>()?.iter().sum::<f32>();
                    break 'waiting;
                }
                Err(Error::Empty) => {} // woken by something that was not a message
                Err(other) => return Err(other.into()),
            }
        }
    }

    // The rest: a plain loop that ends when every worker has gone.
    for result in &mut results {
        let (id, tensor) = result?;
        sums[id] += tensor.to_vec::<f32>()?.iter().sum::<f32>();
    }
    for note in &mut notes {
        println!("note: {}", note?);
    }
    for mut child in children {
        child.wait()?;
    }
    let expected: f32 = (0..STEPS).map(|s| s as f32 * 8.0).sum();
    println!("sums per worker: {sums:?} (each {expected})");
    assert!(sums.iter().all(|&s| s == expected));
    Ok(())
}

fn worker(results: &str, notes: &str, id: usize) -> Fallible {
    let results = Sender::<(usize, Tensor)>::connect(results)?;
    let notes = Sender::<String>::connect(notes)?;
    for step in 0..STEPS {
        let tensor = Tensor::from_slice(&[step as f32; 8], DType::F32, &[8])?;
        results.send(&(id, tensor))?;
        notes.send(&format!("worker {id} sent step {step}"))?;
    }
    Ok(())
}
