//! Where a channel's receiver listens: a Unix socket path on this machine, or a TCP address for
//! senders on other hosts (design decision 10).

use std::path::{Path, PathBuf};
use std::time::Duration;

use ipc_core::seqpacket::Connection;
use ipc_core::tcp::TcpLink;
use ipc_core::transport::Packets;

use crate::error::{EndpointProblem, Error, Refusal, Result};
use crate::secret::Secret;

/// Where a receiver listens and a sender connects.
///
/// A string that starts with `tcp://` is a TCP address (`host:port`); anything else is the path of
/// a Unix socket. So `Receiver::bind(&path)` and `Receiver::bind("tcp://0.0.0.0:7000")` both work.
///
/// ```
/// use tensor_queue::Endpoint;
/// assert_eq!(Endpoint::from("tcp://trainer-3:7000"), Endpoint::Tcp("trainer-3:7000".into()));
/// assert_eq!(Endpoint::from("/tmp/queue.sock"), Endpoint::Unix("/tmp/queue.sock".into()));
/// assert_eq!(Endpoint::Tcp("10.0.0.2:7000".into()).to_string(), "tcp://10.0.0.2:7000");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// A Unix socket on this machine: tensors are shared in place or moved by the routes of
    /// [`crate::route`].
    Unix(PathBuf),
    /// A TCP address (`host:port`): peers authenticate with a shared [`Secret`], and every
    /// tensor moves as between hosts (GPU tensors by NCCL, host tensors over the link), even when
    /// both ends are on one machine.
    Tcp(String),
}

/// The prefix that makes a string a TCP endpoint.
pub(crate) const TCP_PREFIX: &str = "tcp://";

impl Endpoint {
    /// [`Error::BadEndpoint`] for what is neither a socket path nor `tcp://host:port`: another
    /// scheme (`http://...`, which would otherwise be taken for a path), or a TCP address without a
    /// port or with one that is not a number. `bind` and `connect` check this before anything
    /// else.
    ///
    /// ```
    /// use tensor_queue::{Endpoint, EndpointProblem, Error, Receiver};
    /// assert!(Endpoint::from("/tmp/queue.sock").check().is_ok());
    /// assert!(Endpoint::from("tcp://127.0.0.1:0").check().is_ok());
    /// assert!(matches!(Endpoint::from("").check(), Err(Error::BadEndpoint { problem: EndpointProblem::Empty, .. })));
    /// let Err(Error::BadEndpoint { endpoint, problem }) = Receiver::<u32>::bind("tcp://127.0.0.1") else { panic!() };
    /// assert_eq!((endpoint.as_str(), problem), ("tcp://127.0.0.1", EndpointProblem::NoPort));
    /// let Err(error) = Receiver::<u32>::bind("http://127.0.0.1:0") else { panic!() };
    /// assert!(matches!(&error, Error::BadEndpoint { problem: EndpointProblem::Scheme(s), .. } if s == "http"));
    /// assert!(error.to_string().contains("tcp://host:port"), "{error}");
    /// ```
    pub fn check(&self) -> Result<()> {
        let bad = |problem| Err(Error::BadEndpoint { endpoint: self.to_string(), problem });
        match self {
            Endpoint::Unix(path) if path.as_os_str().is_empty() => bad(EndpointProblem::Empty),
            Endpoint::Unix(path) if path.as_os_str().as_encoded_bytes().contains(&0) => bad(EndpointProblem::NulByte),
            Endpoint::Tcp(address) if address.contains('\0') => bad(EndpointProblem::NulByte),
            Endpoint::Tcp(address) if address.contains(['[', ']']) && !is_bracketed_v6(address) => {
                bad(EndpointProblem::Ipv6Brackets)
            }
            Endpoint::Unix(path) => match path.to_str().and_then(scheme) {
                Some(scheme) => bad(EndpointProblem::Scheme(scheme.to_string())),
                None => Ok(()),
            },
            Endpoint::Tcp(address) => {
                // `host:port` or `[v6]:port`: a port after the last colon, outside brackets.
                let port = address.rsplit_once(':').filter(|(_, port)| !port.contains(']')).map(|(_, port)| port);
                match port {
                    Some(port) if port.parse::<u16>().is_ok() => Ok(()),
                    Some(port) => bad(EndpointProblem::BadPort(port.to_string())),
                    None => bad(EndpointProblem::NoPort),
                }
            }
        }
    }
}

/// Whether `address` is `[ADDRESS]:PORT` (or `[ADDRESS]`, which the port check refuses next):
/// one pair of brackets around something, then nothing or the port.
fn is_bracketed_v6(address: &str) -> bool {
    let Some((host, after)) = address.strip_prefix('[').and_then(|rest| rest.split_once(']')) else {
        return false;
    };
    !host.is_empty()
        && !host.contains('[')
        && (after.is_empty() || after.strip_prefix(':').is_some_and(|port| !port.contains(['[', ']'])))
}

/// The scheme of a URL-like text (`http` in `http://host`), if it starts like one.
fn scheme(text: &str) -> Option<&str> {
    let (scheme, _) = text.split_once("://")?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic() && chars.all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))).then_some(scheme)
}

impl From<&str> for Endpoint {
    fn from(text: &str) -> Endpoint {
        match text.strip_prefix(TCP_PREFIX) {
            Some(address) => Endpoint::Tcp(address.to_string()),
            None => Endpoint::Unix(PathBuf::from(text)),
        }
    }
}

impl From<String> for Endpoint {
    fn from(text: String) -> Endpoint {
        Endpoint::from(text.as_str())
    }
}

impl From<&String> for Endpoint {
    fn from(text: &String) -> Endpoint {
        Endpoint::from(text.as_str())
    }
}

impl From<&Path> for Endpoint {
    fn from(path: &Path) -> Endpoint {
        match path.to_str() {
            Some(text) if text.starts_with(TCP_PREFIX) => Endpoint::from(text),
            _ => Endpoint::Unix(path.to_path_buf()),
        }
    }
}

impl From<PathBuf> for Endpoint {
    fn from(path: PathBuf) -> Endpoint {
        Endpoint::from(path.as_path())
    }
}

impl From<&PathBuf> for Endpoint {
    fn from(path: &PathBuf) -> Endpoint {
        Endpoint::from(path.as_path())
    }
}

impl From<&std::ffi::OsStr> for Endpoint {
    fn from(text: &std::ffi::OsStr) -> Endpoint {
        Endpoint::from(Path::new(text))
    }
}

impl From<std::ffi::OsString> for Endpoint {
    fn from(text: std::ffi::OsString) -> Endpoint {
        Endpoint::from(Path::new(&text))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(path) => write!(f, "{}", path.display()),
            Endpoint::Tcp(address) => write!(f, "{TCP_PREFIX}{address}"),
        }
    }
}

/// How a sender connects, for the deprecated [`Sender::connect_with`](crate::Sender::connect_with):
/// build senders with [`Sender::builder`](crate::Sender::builder) instead. Not constructible with
/// a literal (`#[non_exhaustive]`): start from `default()`.
///
/// ```
/// use std::time::Duration;
/// use tensor_queue::{ConnectOptions, Secret};
/// let mut options = ConnectOptions::default();
/// assert_eq!(options.timeout, Duration::from_secs(10));
/// options.secret = Some(Secret::from_bytes(*b"a secret of at least 16 bytes")?);
/// # Ok::<(), tensor_queue::Error>(())
/// ```
///
/// ```compile_fail,E0639
/// let options = tensor_queue::ConnectOptions { secret: None, timeout: std::time::Duration::from_secs(1) };
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// The secret a TCP receiver expects; `None`: the one in `TQ_SECRET`. Unused for Unix sockets.
    pub secret: Option<Secret>,
    /// How long connecting and authenticating over TCP may take together.
    pub timeout: Duration,
    /// Across hosts: a message whose GPU tensors total at most this many bytes sends them
    /// inline over TCP, without NCCL (0: always NCCL); `None`: [`INLINE_GPU_ENV`](crate::route::INLINE_GPU_ENV)'s
    /// value, else [`DEFAULT_INLINE_GPU_UP_TO`](crate::route::DEFAULT_INLINE_GPU_UP_TO).
    pub inline_gpu_up_to: Option<u64>,
}

impl Default for ConnectOptions {
    fn default() -> ConnectOptions {
        ConnectOptions { secret: None, timeout: Duration::from_secs(10), inline_gpu_up_to: None }
    }
}

/// The secret given, else the one in `TQ_SECRET`.
pub(crate) fn secret(given: Option<&Secret>) -> Result<ipc_core::tcp::Secret> {
    match given {
        Some(secret) => Ok(secret.core().clone()),
        None => Ok(Secret::from_env()?.core().clone()),
    }
}

/// A connect that found no socket file, or nobody accepting, as [`Error::NoReceiver`].
fn nobody_there(endpoint: &Endpoint, error: ipc_core::Error) -> Error {
    match error {
        ipc_core::Error::Os { source, .. }
            if matches!(source.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) =>
        {
            Error::NoReceiver { endpoint: endpoint.to_string(), cause: source }
        }
        other => other.into(),
    }
}

/// Connects to `endpoint`: a Unix socket, or a TCP listener that must prove it holds the secret.
pub(crate) fn connect(endpoint: &Endpoint, options: &ConnectOptions) -> Result<Box<dyn Packets>> {
    endpoint.check()?;
    Ok(match endpoint {
        Endpoint::Unix(path) => Box::new(Connection::connect(path).map_err(|error| nobody_there(endpoint, error))?),
        Endpoint::Tcp(address) => {
            let secret = secret(options.secret.as_ref())?;
            Box::new(TcpLink::connect(address.as_str(), &secret, options.timeout).map_err(|error| match error {
                // Turned away before the handshake (a receiver out of descriptors): refused, and why.
                ipc_core::Error::TurnedAway { why, .. } => Error::PeerRefused(Refusal::ByPeer(why.to_string())),
                other => nobody_there(endpoint, other),
            })?)
        }
    })
}
