//! Children started with a channel to them.
//!
//! The channel is a socket pair made before the child starts, so no path exists that another
//! user could create first or connect to. The child's end reaches it as an inherited descriptor,
//! whose number is in [`ENDPOINT_ENV`]:
//! - Its close-on-exec flag is cleared only in the child, between `fork` and `exec`, so children
//!   that other threads start at the same moment do not inherit it.
//! - The child takes it once and sets close-on-exec on it again, so its own children do not
//!   inherit it either.
//!
//! The mechanism (and its `unsafe`) is `ipc_core::inherit`; this module names the variable and
//! turns its errors into this crate's.

use std::os::fd::OwnedFd;
use std::process::{Child, Command};
use std::time::Duration;

use ipc_core::inherit::{TakeError, spawn_with_sockets, take_inherited_sockets};
use ipc_core::seqpacket::Connection;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{DEFAULT_CAPACITY, ENDPOINT_ENV, Receiver, ReceiverOptions, Sender};
use crate::error::{Error, ParentProblem, Result, SpawnStep};

/// Starts `command` as a child with a channel to it: the child calls [`from_parent`] for the
/// receiving end. The child is a fresh process (`exec`), never a fork of this one, so this is safe
/// after CUDA is initialised. The first `send` waits for the child to call `from_parent`; see
/// [`spawn_timeout`] to bound that wait.
///
/// The channel is the child's alone once it has called `from_parent` (the socket is
/// close-on-exec again; a program it starts then finds no channel). Until then its end is an
/// inherited descriptor like any other: a program the child starts before it takes the
/// channel inherits it, may take it instead, and keeps it open while it lives.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use std::process::Command;
/// // In the parent:
/// let (mut child, work) = tensor_queue::spawn::<String>(&mut Command::new("./worker"))?;
/// work.send(&"hello".to_string())?;
/// drop(work);
/// // In ./worker:
/// let mut work = tensor_queue::from_parent::<String>()?;
/// println!("{}", work.recv()?);
/// # Ok(()) }
/// ```
pub fn spawn<T: Serialize>(command: &mut Command) -> Result<(Child, Sender<T>)> {
    let (child, mut ours) = start(command, 1)?;
    let sender = Sender::from_connection(ours.remove(0))?;
    Ok((child, sender))
}

/// [`spawn`], then waits up to `timeout` for the child to take its end ([`Sender::wait_ready`]).
/// A child that exits first ([`Error::ChildNotReady`] with [`SpawnStep::Exited`]), or does not take it in time
/// ([`Error::Timeout`]), is killed and reaped; [`spawn_ready`] says which step in the error.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use std::process::Command;
/// use std::time::Duration;
/// let mut worker = Command::new("./worker");
/// // A worker that fails before it takes its end is an error here, not a hang at the first send.
/// let (mut child, jobs) = tensor_queue::spawn_timeout::<String>(&mut worker, Duration::from_secs(30))?;
/// jobs.send(&"job 1".to_string())?;
/// drop(jobs); // the worker's `recv` then says Disconnected
/// assert!(child.wait().expect("reaping the worker").success());
/// # Ok(()) }
/// ```
pub fn spawn_timeout<T: Serialize>(command: &mut Command, timeout: Duration) -> Result<(Child, Sender<T>)> {
    spawn_ready(command, timeout).map_err(|error| match error {
        // `Error::Timeout` carries no text; the log says which step it was (`spawn_ready` says
        // it in the error).
        Error::ChildNotReady { program, step: SpawnStep::TakeChannel { timeout } } => {
            tracing::warn!(program, ?timeout, "the child did not take its channel (from_parent) in time; killed");
            Error::Timeout
        }
        // A child that exited stays Error::ChildNotReady: the caller can read its status.
        other => other,
    })
}

/// [`spawn_timeout`] with the failed step in the error: a child that does not take its end in
/// time, or exits first, is killed and reaped and is [`Error::ChildNotReady`] with the
/// [`SpawnStep`] (where `spawn_timeout` gives [`Error::Timeout`] for the first).
///
/// ```
/// use std::process::Command;
/// use std::time::Duration;
/// use tensor_queue::{Error, SpawnStep};
/// // `true` exits at once without taking its channel.
/// match tensor_queue::spawn_ready::<u32>(&mut Command::new("true"), Duration::from_secs(30)) {
///     Err(Error::ChildNotReady { program, step: SpawnStep::Exited { status } }) => {
///         assert_eq!(program, "true");
///         assert!(status.success());
///     }
///     other => panic!("expected ChildNotReady, got {:?}", other.map(|_| ())),
/// }
/// // `sleep 30` never takes it: killed when the second is up.
/// match tensor_queue::spawn_ready::<u32>(Command::new("sleep").arg("30"), Duration::from_secs(1)) {
///     Err(Error::ChildNotReady { step: SpawnStep::TakeChannel { timeout }, .. }) => {
///         assert_eq!(timeout, Duration::from_secs(1));
///     }
///     other => panic!("expected ChildNotReady, got {:?}", other.map(|_| ())),
/// }
/// ```
pub fn spawn_ready<T: Serialize>(command: &mut Command, timeout: Duration) -> Result<(Child, Sender<T>)> {
    let (mut child, sender) = spawn(command)?;
    match sender.wait_ready(timeout) {
        Ok(()) => Ok((child, sender)),
        Err(error) => {
            let _ = child.kill();
            let status = child.wait().map_err(|source| ipc_core::Error::Os { what: "reaping the child", source })?;
            let step = match error {
                Error::Timeout => SpawnStep::TakeChannel { timeout },
                _ => SpawnStep::Exited { status },
            };
            Err(Error::ChildNotReady { program: program(command), step })
        }
    }
}

/// Starts `command` as a child with a channel each way: requests to it, answers from it (the
/// child calls [`from_parent_duplex`]). Answers may come from any thread of the child, while
/// requests are still being sent.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use std::process::Command;
/// // In the parent:
/// let (_child, numbers, mut doubled) = tensor_queue::spawn_duplex::<u64, u64>(&mut Command::new("./doubler"))?;
/// numbers.send(&21)?;
/// assert_eq!(doubled.recv()?, 42);
/// // In ./doubler:
/// let (mut numbers, doubled) = tensor_queue::from_parent_duplex::<u64, u64>()?;
/// while let Ok(n) = numbers.recv() {
///     doubled.send(&(n * 2))?;
/// }
/// # Ok(()) }
/// ```
pub fn spawn_duplex<Request: Serialize, Answer: DeserializeOwned>(
    command: &mut Command,
) -> Result<(Child, Sender<Request>, Receiver<Answer>)> {
    let (child, mut ours) = start(command, 2)?;
    let answers = Receiver::from_connection(ours.remove(1), DEFAULT_CAPACITY)?;
    let requests = Sender::from_connection(ours.remove(0))?;
    Ok((child, requests, answers))
}

/// Starts `command` with `count` socket pairs, the child's ends inherited; our ends, in order.
fn start(command: &mut Command, count: usize) -> Result<(Child, Vec<Connection>)> {
    spawn_with_sockets(command, ENDPOINT_ENV, count).map_err(|error| match error {
        ipc_core::Error::Os { what: "starting the child", source } => {
            Error::ChildNotStarted { program: program(command), source }
        }
        other => other.into(),
    })
}

/// The program `command` runs, for messages.
fn program(command: &Command) -> String {
    std::path::Path::new(command.get_program()).display().to_string()
}

/// In a child started by [`spawn`]: the receiving end of the channel from the parent.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// // In ./worker, started by `tensor_queue::spawn::<Tensor>`:
/// use tensor_queue::{Error, Tensor};
/// let mut jobs = tensor_queue::from_parent::<Tensor>()?;
/// loop {
///     match jobs.recv() {
///         Ok(t) => println!("{} elements", t.numel()),
///         Err(Error::Disconnected) => break, // the parent dropped its sender
///         Err(other) => return Err(other),
///     }
/// }
/// # Ok(()) }
/// ```
pub fn from_parent<T: DeserializeOwned>() -> Result<Receiver<T>> {
    from_parent_with_capacity(DEFAULT_CAPACITY)
}

/// [`from_parent`], letting the parent have `capacity` messages in flight.
///
/// The descriptor can be taken once per process: a second call is an error.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// // In a worker that takes its jobs 64 at a time: the parent may send that far ahead.
/// let mut jobs = tensor_queue::from_parent_with_capacity::<Vec<u8>>(64)?;
/// let batch: Vec<Vec<u8>> = (0..64).map_while(|_| jobs.recv().ok()).collect();
/// println!("{} jobs", batch.len());
/// # Ok(()) }
/// ```
pub fn from_parent_with_capacity<T: DeserializeOwned>(capacity: u32) -> Result<Receiver<T>> {
    from_parent_options(ReceiverOptions { capacity, ..ReceiverOptions::default() })
}

/// [`from_parent`] with `options` (the capacity per sender, and the routing policy).
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// # #![allow(deprecated)]
/// use tensor_queue::route::{Landing, Routing};
/// use tensor_queue::{ReceiverOptions, Tensor, from_parent_with};
/// // A child that wants every tensor in host memory:
/// let mut options = ReceiverOptions::default();
/// options.routing = Routing::default().land(Landing::Host);
/// let mut inputs = from_parent_with::<Tensor>(options)?;
/// let x = inputs.recv()?;
/// # drop(x); Ok(()) }
/// ```
#[deprecated(note = "use `Receiver::builder().capacity(..).routing(..).from_parent()`")]
pub fn from_parent_with<T: DeserializeOwned>(options: ReceiverOptions) -> Result<Receiver<T>> {
    from_parent_options(options)
}

/// [`from_parent`] with `options` (what the builder and the deprecated `from_parent_with` do).
pub(super) fn from_parent_options<T: DeserializeOwned>(options: ReceiverOptions) -> Result<Receiver<T>> {
    let mut sockets = take_parent_sockets()?;
    Receiver::from_connection_with(Connection::from(sockets.remove(0)), options)
}

/// In a child started by [`spawn_duplex`]: the requests from the parent, and the answers to it.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// // In ./tokenizer, started by `tensor_queue::spawn_duplex::<String, Vec<u32>>`:
/// let (mut texts, tokens) = tensor_queue::from_parent_duplex::<String, Vec<u32>>()?;
/// while let Ok(text) = texts.recv() {
///     tokens.send(&text.bytes().map(u32::from).collect())?;
/// }
/// # Ok(()) }
/// ```
pub fn from_parent_duplex<Request: DeserializeOwned, Answer: Serialize>() -> Result<(Receiver<Request>, Sender<Answer>)>
{
    let mut sockets = take_parent_sockets()?;
    if sockets.len() != 2 {
        return Err(Error::NoParentChannel(ParentProblem::NotDuplex));
    }
    let answers = Sender::from_connection(Connection::from(sockets.remove(1)))?;
    let requests = Receiver::from_connection(Connection::from(sockets.remove(0)), DEFAULT_CAPACITY)?;
    Ok((requests, answers))
}

/// Takes ownership of the sockets that [`spawn`] or [`spawn_duplex`] left open in this process.
fn take_parent_sockets() -> Result<Vec<OwnedFd>> {
    let variable = ENDPOINT_ENV;
    take_inherited_sockets(variable).map_err(|error| match error {
        TakeError::NotSet => Error::NoParentChannel(ParentProblem::NotSpawned { variable }),
        TakeError::NotAList { value } => Error::NoParentChannel(ParentProblem::NotAList { variable, value }),
        TakeError::AlreadyTaken => Error::NoParentChannel(ParentProblem::AlreadyTaken),
        TakeError::NotASocket { fd } => Error::NoParentChannel(ParentProblem::NotASocket { variable, fd }),
        TakeError::Core(error) => error.into(),
        other => Error::NoParentChannel(ParentProblem::Other(other.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::process::Stdio;

    use ipc_core::inherit::close_on_exec;

    use super::*;

    const NAME: &str = "channel::child::tests::a_child_gets_a_socket_not_a_path_and_takes_it_once";

    /// The test binary starts itself as the child, which runs this test again and takes the
    /// other branch.
    #[test]
    fn a_child_gets_a_socket_not_a_path_and_takes_it_once() {
        if std::env::var_os(ENDPOINT_ENV).is_some() {
            return child_side();
        }
        // Another user could create the paths the socket once had; nothing depends on them now.
        let squatted: Vec<PathBuf> = (0..32)
            .map(|n| std::env::temp_dir().join(format!("tensor-queue-{}-{n}.sock", std::process::id())))
            .collect();
        for path in &squatted {
            std::fs::create_dir_all(path).unwrap();
        }
        assert!(!crate::is_spawned_child());
        let mut command = Command::new(std::env::current_exe().unwrap());
        command.args(["--exact", NAME, "--test-threads=1", "--nocapture"]).stdout(Stdio::piped());
        let started = spawn::<u32>(&mut command);
        for path in &squatted {
            let _ = std::fs::remove_dir(path);
        }
        let (child, sender) = started.unwrap();
        sender.send(&42).unwrap();
        drop(sender);
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{stdout}");
        assert!(stdout.contains("1 passed"), "the child ran the test: {stdout}");
    }

    fn child_side() {
        let raw: std::os::fd::RawFd = std::env::var(ENDPOINT_ENV).unwrap().parse().expect("one descriptor number");
        assert!(crate::is_spawned_child());
        assert_eq!(close_on_exec(raw), Some(false), "spawn cleared close-on-exec for the child");
        let mut receiver = from_parent::<u32>().unwrap();
        assert_eq!(close_on_exec(raw), Some(true), "our own children do not inherit it");
        let again = from_parent::<u32>().map(drop);
        assert!(matches!(again, Err(Error::NoParentChannel(ParentProblem::AlreadyTaken))), "{again:?}");
        assert!(again.unwrap_err().to_string().contains("already taken"));
        assert_eq!(receiver.recv().unwrap(), 42);
    }
}
