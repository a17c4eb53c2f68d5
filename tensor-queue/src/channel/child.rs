//! Children started with a channel to them.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ipc_core::seqpacket::{Connection, Listener};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{DEFAULT_CAPACITY, ENDPOINT_ENV, Receiver, Sender};
use crate::{Error, Result};

/// Starts `command` as a child with a channel to it: the child calls [`from_parent`] for the
/// receiving end. The child is a fresh process (`exec`), never a fork of this one, so this is safe
/// after CUDA is initialised.
pub fn spawn<T: Serialize>(command: &mut Command) -> Result<(Child, Sender<T>)> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("tensor-queue-{}-{n}.sock", std::process::id()));
    let listener = Listener::bind(&path)?;
    let mut child =
        command.env(ENDPOINT_ENV, &path).spawn().map_err(|e| Error::Invalid(format!("starting the child: {e}")))?;
    loop {
        match listener.accept(Some(Duration::from_millis(100))) {
            Ok(connection) => return Ok((child, Sender::from_connection(connection)?)),
            Err(ipc_core::Error::Os { source, .. }) if source.kind() == std::io::ErrorKind::TimedOut => {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(Error::Invalid(format!("the child exited ({status}) before connecting")));
                }
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// In a child started by [`spawn`]: the receiving end of the channel from the parent.
pub fn from_parent<T: DeserializeOwned>() -> Result<Receiver<T>> {
    from_parent_with_capacity(DEFAULT_CAPACITY)
}

/// [`from_parent`], letting the parent have `capacity` messages in flight.
pub fn from_parent_with_capacity<T: DeserializeOwned>(capacity: u32) -> Result<Receiver<T>> {
    let path = std::env::var_os(ENDPOINT_ENV).ok_or_else(|| {
        Error::Invalid(format!("{ENDPOINT_ENV} is not set: was this process started by tensor_queue::spawn?"))
    })?;
    Receiver::from_connection(Connection::connect(path)?, capacity)
}
