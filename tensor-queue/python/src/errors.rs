//! Rust errors as the Python exception classes of `tensor_queue._errors` (defined in Python, so
//! that each can also subclass the builtin exception that means the same).

use pyo3::prelude::*;
use pyo3::types::PyType;
use tensor_queue::Error;

/// The Python exception for `error`.
pub fn to_py(error: Error) -> PyErr {
    let class = match &error {
        Error::Disconnected => "Disconnected",
        Error::Timeout => "Timeout",
        Error::Full => "Full",
        Error::Empty => "Empty",
        Error::Rejected { .. } => "Rejected",
        Error::ProducerFailed { .. } => "ProducerFailed",
        Error::TooLarge { .. } => "TooLarge",
        Error::NotSendable(_) => "NotSendable",
        Error::RouteRefused(_) => "RouteRefused",
        // A TCP peer that failed the secret's challenge is refused as surely as one of another user.
        Error::PeerRefused(_) | Error::Core(ipc_core::Error::AuthFailed { .. }) => "PeerRefused",
        // Nobody at the address: a ConnectionRefusedError in Python.
        Error::NoReceiver { .. } => "NoReceiver",
        // Connecting took the whole timeout (a TimeoutError in Python, as `recv`'s).
        Error::Core(ipc_core::Error::HandshakeTimeout { .. }) => "Timeout",
        Error::Core(ipc_core::Error::Os { source, .. }) if source.kind() == std::io::ErrorKind::TimedOut => "Timeout",
        // A system call's failure: an OSError in Python (it was a bare TensorQueueError).
        Error::Core(ipc_core::Error::Os { .. }) => "SystemCallError",
        // Bad arguments (a ValueError in Python).
        Error::Invalid(_)
        | Error::Tensor(_)
        | Error::View { .. }
        | Error::TooManySources { .. }
        | Error::NothingToSelect
        | Error::NoParentChannel(_)
        | Error::NoRuntime
        | Error::BadEndpoint { .. }
        | Error::ReadOnly
        | Error::SecretTooShort { .. }
        | Error::SecretNotSet { .. } => "InvalidArgument",
        Error::Frame { .. }
        | Error::Violation(_)
        | Error::ConnectionClosed { .. }
        | Error::Decode(_)
        | Error::Encode(_) => "ProtocolError",
        // A message lost with its connection, a bug of this crate, the driver or the system.
        Error::NcclMessageLost { .. } | Error::Internal(_) | Error::Core(_) => "TensorQueueError",
        _ => "TensorQueueError",
    };
    // An OSError subclass carries the system's errno, as Python's own do (`except OSError as e:
    // if e.errno == errno.ENOENT`).
    let errno = match &error {
        Error::NoReceiver { cause, .. } => cause.raw_os_error(),
        Error::Core(ipc_core::Error::Os { source, .. }) => errno_of(source),
        _ => None,
    };
    if let Some(errno) = errno {
        return raise_with(class, (errno, error.to_string()));
    }
    raise(class, error.to_string())
}

/// The system's error number of `error`: its own, or the one its kind stands for where the
/// library made it (a path in use is found before `bind` says so).
fn errno_of(error: &std::io::Error) -> Option<i32> {
    use std::io::ErrorKind;
    error.raw_os_error().or(match error.kind() {
        ErrorKind::AddrInUse => Some(rustix::io::Errno::ADDRINUSE.raw_os_error()),
        ErrorKind::NotFound => Some(rustix::io::Errno::NOENT.raw_os_error()),
        ErrorKind::PermissionDenied => Some(rustix::io::Errno::ACCESS.raw_os_error()),
        _ => None,
    })
}

/// Whether `error` is one of this package's (`TensorQueueError` or a subclass).
pub fn is_ours(py: Python<'_>, error: &PyErr) -> bool {
    let base = py.import("tensor_queue._errors").and_then(|module| module.getattr("TensorQueueError"));
    base.and_then(|base| Ok(base.cast_into::<PyType>()?)).is_ok_and(|base| error.matches(py, base).unwrap_or(false))
}

/// An instance of `tensor_queue._errors.<class>` with `message`.
pub fn raise(class: &str, message: impl Into<String>) -> PyErr {
    raise_with(class, message.into())
}

/// An instance of `tensor_queue._errors.<class>` made with `args`.
fn raise_with<A: pyo3::PyErrArguments + Send + Sync + 'static>(class: &str, args: A) -> PyErr {
    Python::attach(|py| {
        let found = py
            .import("tensor_queue._errors")
            .and_then(|module| module.getattr(class))
            .and_then(|class| class.cast_into::<PyType>().map_err(PyErr::from));
        match found {
            Ok(class) => PyErr::from_type(class, args),
            Err(missing) => missing,
        }
    })
}
