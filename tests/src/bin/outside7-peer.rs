//! The second process of `tests/tests/outside_round7.rs`: an outside user's program that uses only
//! the public API of tensor-queue over TCP (the secret from `TQ_SECRET`, as the README says a
//! user's program does). Each mode is one role; it reports on stdout, one line a step, and waits
//! for its stdin to close before it exits (the test may SIGKILL it anywhere).

use std::io::BufRead;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use integration_tests::outside7::{Msg, bytes, check, message};
use integration_tests::program::{connect, say};
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

fn kill_myself() -> Result<()> {
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL)?;
    bail!("still alive after SIGKILL")
}

fn wait_for_stdin_to_close() {
    let _ = std::io::stdin().lock().lines().count();
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("");
    match mode {
        // `send ENDPOINT FIRST_ID THREADS COUNT TOP END`: THREADS threads send COUNT messages each
        // (`outside7::message(FIRST_ID + t, i, TOP)`); odd threads share a clone of the previous
        // thread's `Sender`, even ones connect their own. Says "sent-all" once every send returned,
        // then END: "wait" (`wait_written`, says "written BOOL", waits for stdin), "die" (SIGKILLs
        // itself at once) or "written-die" (`wait_written`, says "written BOOL", then SIGKILL).
        "send" => {
            let endpoint = args[1].clone();
            let first: u32 = args[2].parse()?;
            let threads: u32 = args[3].parse()?;
            let count: u64 = args[4].parse()?;
            let top: usize = args[5].parse()?;
            let end = args[6].as_str();
            let mut senders: Vec<Sender<Msg>> = Vec::new();
            for t in 0..threads {
                let sender = if t % 2 == 1 { senders[t as usize - 1].clone() } else { connect::<Msg>(&endpoint)? };
                senders.push(sender);
            }
            let handles: Vec<_> = senders
                .iter()
                .cloned()
                .enumerate()
                .map(|(t, sender)| {
                    std::thread::spawn(move || -> Result<()> {
                        for i in 0..count {
                            sender.send(&message(first + t as u32, i, top)).with_context(|| format!("send {i}"))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            integration_tests::program::join_senders(handles)?;
            say("sent-all");
            match end {
                "die" => kill_myself()?,
                "written-die" | "wait" => {
                    let written = senders.iter().all(|s| s.wait_written(Duration::from_secs(60)));
                    say(&format!("written {written}"));
                    if end == "written-die" {
                        kill_myself()?;
                    }
                    wait_for_stdin_to_close();
                }
                other => bail!("unknown end {other}"),
            }
        }
        // `big ENDPOINT LEN`: one message (77, 0, [LEN pseudo-random bytes]); says "sending",
        // "sent" once `send` returned, "written BOOL", then waits for stdin.
        "big" => {
            let sender = connect::<Msg>(&args[1])?;
            let len: usize = args[2].parse()?;
            let payload = Tensor::from_bytes(&bytes(77, 0, len), DType::U8, &[len as u64])?;
            say("sending");
            sender.send(&(77, 0, vec![payload]))?;
            say("sent");
            say(&format!("written {}", sender.wait_written(Duration::from_secs(120))));
            wait_for_stdin_to_close();
        }
        // `until-full ENDPOINT ID TOP`: `send_timeout` (500 ms) messages until one fails; says
        // "accepted N" and "stopped DEBUG", then "try_send DEBUG" for one `try_send`; waits for the
        // line "go", sends the refused message and two more with `send`, says "more N" (the next
        // index) and "written BOOL", then waits for stdin to close.
        "until-full" => {
            let sender = connect::<Msg>(&args[1])?;
            let id: u32 = args[2].parse()?;
            let top: usize = args[3].parse()?;
            let mut next = 0u64;
            let stopped = loop {
                match sender.send_timeout(&message(id, next, top), Duration::from_millis(500)) {
                    Ok(()) => next += 1,
                    Err(e) => break e,
                }
                if next > 10_000 {
                    bail!("10,000 messages accepted by a receiver that does not read");
                }
            };
            say(&format!("accepted {next}"));
            say(&format!("stopped {stopped:?}"));
            let tried = sender.try_send(&message(id, next, top));
            say(&format!("try_send {tried:?}"));
            if tried.is_ok() {
                next += 1;
            }
            let mut lines = std::io::stdin().lock().lines();
            while lines.next().transpose()?.as_deref() != Some("go") {}
            for _ in 0..3 {
                sender.send(&message(id, next, top))?;
                next += 1;
            }
            say(&format!("more {next}"));
            say(&format!("written {}", sender.wait_written(Duration::from_secs(60))));
            let _ = lines.count();
        }
        // `recv CAPACITY COUNT TOP`: binds a TCP receiver on a free loopback port, says "port P",
        // receives COUNT messages, checking each ("got SENDER INDEX" or "bad WHY"), says "done" and
        // waits for stdin (the test kills it mid-transfer).
        "recv" => {
            let capacity: u32 = args[1].parse()?;
            let count: u64 = args[2].parse()?;
            let top: usize = args[3].parse()?;
            let mut receiver = Receiver::<Msg>::builder().capacity(capacity).bind("tcp://127.0.0.1:0")?;
            say(&format!("port {}", receiver.local_addr().context("no address")?.port()));
            for _ in 0..count {
                let msg = receiver.recv()?;
                match check(&msg, top) {
                    Ok(()) => say(&format!("got {} {}", msg.0, msg.1)),
                    Err(why) => say(&format!("bad {why}")),
                }
            }
            say("done");
            wait_for_stdin_to_close();
        }
        // `exchange ENDPOINT`: binds a TCP receiver (capacity 4), says "port P", connects to
        // ENDPOINT and sends it three 64 MiB messages (sender 2, indices 3, 1003, 2003) before receiving
        // anything, says "sent 3", then receives three messages and says "got SENDER INDEX" or
        // "bad WHY" for each; waits for stdin.
        "exchange" => {
            let mut receiver = Receiver::<Msg>::builder().capacity(4).bind("tcp://127.0.0.1:0")?;
            say(&format!("port {}", receiver.local_addr().context("no address")?.port()));
            let sender = connect::<Msg>(&args[1])?;
            for i in [3, 1003, 2003] {
                sender.send(&message(2, i, 7))?;
            }
            say("sent 3");
            for _ in 0..3 {
                let msg = receiver.recv()?;
                match check(&msg, 7) {
                    Ok(()) => say(&format!("got {} {}", msg.0, msg.1)),
                    Err(why) => say(&format!("bad {why}")),
                }
            }
            wait_for_stdin_to_close();
        }
        // `connect ENDPOINT`: one `connect` (no retry); says "connected" or "error DEBUG".
        "connect" => {
            match Sender::<Msg>::builder().timeout(Duration::from_secs(30)).connect(&args[1]) {
                Ok(sender) => {
                    say("connected");
                    let sent = sender.send_timeout(&message(66, 0, 3), Duration::from_secs(10));
                    say(&format!("send {sent:?}"));
                }
                Err(Error::Core(e)) => say(&format!("error Core({e:?})")),
                Err(e) => say(&format!("error {e:?}")),
            }
            wait_for_stdin_to_close();
        }
        other => bail!("unknown mode {other:?}"),
    }
    Ok(())
}
