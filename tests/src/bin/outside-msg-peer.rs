//! The second process of `tests/tests/outside_messages.rs`: an outside user's program that uses
//! only tensor-queue's public API. The first argument is its role; it reports on stdout, one line
//! a step (`error <Debug>` and exit status 1 when something went wrong), and reads commands from
//! stdin where its role waits for the test.

use std::io::BufRead;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use integration_tests::outside_messages::{
    Held, Many, OverTcp, Shuffle, Tagged, check_held, check_many, check_mixed_storages, check_shared_storage,
    check_tensor, many, mixed_storages, odd, shared_storage, tagged,
};
use integration_tests::program::say;
use integration_tests::{arg, number};
use tensor_queue::{Context, Error, Receiver, Sender, Stream, Tensor};

/// How long any wait of this program may take before it gives up (the test's own bounds are
/// what fail it; this only keeps an orphan from lingering).
const BOUND: Duration = Duration::from_secs(60);

/// The next line on stdin (`None` at its end).
fn command() -> Option<String> {
    std::io::stdin().lock().lines().next().and_then(|line| line.ok())
}

/// Waits for stdin to close (the test's way of ending a role that must stay alive).
fn wait_for_eof() {
    let _ = std::io::stdin().lock().lines().count();
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(error) = run(&args) {
        // The Debug form names the variant, which tests match on.
        let root = error.downcast_ref::<Error>().map_or_else(|| format!("{error:#}"), |e| format!("{e:?}"));
        say(&format!("error {root}"));
        std::process::exit(1);
    }
}

fn run(args: &[String]) -> Result<()> {
    let role = args.first().map(String::as_str).unwrap_or("");
    let to = || arg(args, "--to").context("--to ENDPOINT");
    let count = number(args, "--count", 1)?;
    match role {
        // Receives `Many` messages from the parent until it goes, checking every byte and
        // stride; `--gpu` makes the peer keep a context open so that GPU tensors land there.
        "recv-many" => {
            let mut receiver = tensor_queue::from_parent::<Many>()?;
            let mut n = 0;
            loop {
                match receiver.recv_timeout(BOUND) {
                    Ok(message) => {
                        check_many(&message, true)?;
                        n += 1;
                        say(&format!("ok {}", message.id));
                    }
                    Err(Error::Disconnected) => break,
                    Err(other) => return Err(other.into()),
                }
            }
            say(&format!("done {n}"));
        }
        // Receives `(id, mixed_storages(id))` messages from the parent until it goes, checking
        // every tensor's layout and bytes (and holding each message until the next is checked).
        "recv-mixed" => {
            let mut receiver = tensor_queue::from_parent::<(u64, Vec<Tensor>)>()?;
            let mut held = None;
            loop {
                match receiver.recv_timeout(BOUND) {
                    Ok((id, tensors)) => {
                        check_mixed_storages(id, &tensors)?;
                        say(&format!("ok {id} {}", tensors.len()));
                        held = Some(tensors);
                    }
                    Err(Error::Disconnected) => break,
                    Err(other) => return Err(other.into()),
                }
            }
            drop(held);
            say("done");
        }
        // Connects to `--to` and sends `(id, mixed_storages(id))` for ids 0..count, then
        // `(99, shared_storage(5))`; says `sent` once all are written and waits for stdin to close.
        "send-mixed" => {
            let sender = Sender::<(u64, Vec<Tensor>)>::connect(to()?.as_str())?;
            for id in 0..count {
                sender.send(&(id, mixed_storages(id)?))?;
            }
            sender.send(&(99, shared_storage(5)?))?;
            if !sender.wait_written(BOUND) {
                bail!("the messages were not written within {BOUND:?}");
            }
            say("sent");
            wait_for_eof();
        }
        // Receives `shared_storage(3)`, checks it, then drops all but its last tensor and the
        // last when told.
        "partial" => {
            let mut receiver = tensor_queue::from_parent::<Vec<Tensor>>()?;
            let mut tensors = receiver.recv_timeout(BOUND)?;
            check_shared_storage(3, &tensors)?;
            say(&format!("ok {}", tensors.len()));
            command().context("expected `drop all but one`")?;
            let last = tensors.pop().context("no tensor")?;
            drop(tensors);
            say("1 left");
            command().context("expected `drop the last`")?;
            let expected = shared_storage(3)?.pop().context("no tensor")?;
            check_tensor("the last tensor, after the others were dropped", &last, &expected, true)?;
            drop(last);
            say("0 left");
            wait_for_eof();
        }
        // Receives two views of one writable storage, writes through the first and reports what
        // the second (overlapping it) reads at the same element.
        "alias" => {
            let mut receiver = tensor_queue::from_parent::<(Tensor, Tensor)>()?;
            let (a, b) = receiver.recv_timeout(BOUND)?;
            a.set(&[5, 3], 4242i32)?; // a = rows 0..40: element [5, 3] is b's [5 - 2, 3] (b = rows 2..)
            say(&format!("b sees {}", b.get::<i32>(&[3, 3])?));
            wait_for_eof();
        }
        // Sends `count` `Many` messages (from id `--first`), says when `send` has returned for all
        // (`sent`) and when their bytes are all in the socket (`written`), then stays alive until
        // stdin closes (or the test kills it); with `--exit`, returns from main right after `sent`.
        "send-many" => {
            let sender = Sender::<Many>::connect(to()?.as_str())?;
            let first = number(args, "--first", 0)?;
            for id in first..first + count {
                sender.send(&many(id, None)?)?;
            }
            say("sent");
            if args.iter().any(|a| a == "--exit") {
                return Ok(()); // main returns at once: the Sender's drop finishes the writing
            }
            if !sender.wait_written(BOUND) {
                bail!("the messages were not written within {BOUND:?}");
            }
            say("written");
            wait_for_eof();
        }
        // Receives `count` `Held` messages (capacity `--capacity`), checks and holds them all;
        // on `close` drops its receiver but keeps them; on `drop SEED` drops them in that seed's
        // random order; then waits for stdin to close.
        "hold" => {
            let capacity = number(args, "--capacity", 16)? as u32;
            let mut receiver = Receiver::<Held>::builder().capacity(capacity).from_parent()?;
            let mut holding = Vec::new();
            for _ in 0..count {
                let message = receiver.recv_timeout(BOUND)?;
                check_held(&message)?;
                holding.push(message);
            }
            say(&format!("holding {}", holding.len()));
            let Some(mut line) = command() else { return Ok(()) };
            if line == "close" {
                // Closes the channel but keeps the messages (and their tensors).
                drop(receiver);
                for message in &holding {
                    check_held(message)?;
                }
                say("closed");
                line = command().context("expected `drop SEED`")?;
            }
            let seed: u64 = line.strip_prefix("drop ").context("expected `drop SEED`")?.trim().parse()?;
            Shuffle::new(seed).shuffle(&mut holding);
            while let Some(message) = holding.pop() {
                drop(message);
            }
            say("dropped");
            wait_for_eof();
        }
        // Holds GPU `Many` messages then drops them in random order (the GPU variant of `hold`).
        "hold-many" => {
            let mut receiver = Receiver::<Many>::builder().capacity(count as u32).from_parent()?;
            let mut holding = Vec::new();
            for _ in 0..count {
                let message = receiver.recv_timeout(BOUND)?;
                check_many(&message, true)?;
                holding.push(message);
            }
            say(&format!("holding {}", holding.len()));
            let Some(line) = command() else { return Ok(()) };
            let seed: u64 = line.strip_prefix("drop ").context("expected `drop SEED`")?.trim().parse()?;
            Shuffle::new(seed).shuffle(&mut holding);
            drop(holding);
            say("dropped");
            wait_for_eof();
        }
        // Several senders in this process, each on its own thread and connection, `count`
        // `Tagged` messages each; `--clones` more threads send through clones of sender 0.
        "senders" => {
            let endpoint = to()?;
            let senders = number(args, "--senders", 3)? as u32;
            let clones = number(args, "--clones", 0)? as u32;
            let first = Sender::<Tagged>::connect(endpoint.as_str())?;
            let pid = std::process::id();
            let threads: Vec<_> = (0..senders + clones)
                .map(|s| {
                    let sender =
                        if s == 0 || s >= senders { Ok(first.clone()) } else { Sender::connect(endpoint.as_str()) };
                    std::thread::spawn(move || -> Result<()> {
                        let sender = sender?;
                        for seq in 0..count {
                            sender.send(&tagged(pid, s, seq)?)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            for thread in threads {
                thread.join().map_err(|_| anyhow::anyhow!("a sender thread panicked"))??;
            }
            say("done");
        }
        // A receiver that reads only when told (`read K`), `Held` messages with capacity
        // `--capacity`, from the parent or bound at `--at`; it prints the ids it read, and ends
        // when stdin closes.
        "reader" => {
            let capacity = number(args, "--capacity", 2)? as u32;
            let builder = Receiver::<Held>::builder().capacity(capacity);
            let mut receiver = match arg(args, "--at") {
                // Over TCP (secret from TQ_SECRET): the test connects to the port printed.
                Some(endpoint) => {
                    let receiver = builder.bind(endpoint.as_str())?;
                    let address = receiver.local_addr().context("bound to TCP")?;
                    say(&format!("ready tcp://{address}"));
                    receiver
                }
                None => {
                    let receiver = builder.from_parent()?;
                    say("ready");
                    receiver
                }
            };
            while let Some(line) = command() {
                let k: usize = line.strip_prefix("read ").context("expected `read K`")?.trim().parse()?;
                let mut ids = Vec::new();
                for _ in 0..k {
                    let message = receiver.recv_timeout(BOUND)?;
                    check_held(&message)?;
                    ids.push(message.id.to_string());
                }
                say(&format!("got {}", ids.join(" ")));
            }
        }
        // Sends `count` `u64`s, each with a tensor on every tenth, as fast as credits allow.
        "flood" => {
            let sender = Sender::<(u64, Option<Tensor>)>::connect(to()?.as_str())?;
            for i in 0..count {
                let tensor = (i % 10 == 0).then(|| Tensor::new(&[i as i64; 4], &[2, 2])).transpose()?;
                sender.send(&(i, tensor))?;
            }
            say("done");
        }
        // Connects over TCP (secret from TQ_SECRET) and sends `count` `OverTcp` messages.
        "tcp-send" => {
            let sender = Sender::<OverTcp>::builder().timeout(Duration::from_secs(20)).connect(to()?.as_str())?;
            for id in 0..count {
                sender.send(&OverTcp { many: many(id, None)?, odd: odd(id)? })?;
            }
            say("sent");
        }
        // Sends GPU `Many` messages (the GPU variant of `send-many`).
        "send-many-gpu" => {
            let stream = Stream::new(&Context::on_ordinal(0)?)?;
            let sender = Sender::<Many>::connect(to()?.as_str())?;
            for id in 0..count {
                sender.send_on(&many(id, Some(&stream))?, &stream)?;
            }
            stream.synchronize()?;
            if !sender.wait_written(BOUND) {
                bail!("the messages were not written within {BOUND:?}");
            }
            say("written");
            wait_for_eof();
        }
        other => bail!("unknown role {other:?}"),
    }
    Ok(())
}
