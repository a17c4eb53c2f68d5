//! The TCP link's shared secret, with this crate's errors.

use ipc_core::tcp::{MIN_SECRET_LEN, SECRET_ENV};

use crate::error::{Error, Result};

/// A shared secret of at least [`MIN_SECRET_LEN`](crate::MIN_SECRET_LEN) bytes, which a TCP
/// receiver and its senders must all hold. Its `Debug` shows only its length, and its bytes are
/// overwritten with zeros when it drops.
///
/// ```
/// use tensor_queue::{Error, Secret};
/// let secret = Secret::from_bytes(*b"a secret of at least 16 bytes")?;
/// assert_eq!(format!("{secret:?}"), "Secret { len: 29, .. }");
/// match Secret::from_bytes(*b"short") {
///     Err(Error::SecretTooShort { len: 5, min: 16, .. }) => {}
///     other => panic!("expected SecretTooShort, got {other:?}"),
/// }
/// # Ok::<(), tensor_queue::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(ipc_core::tcp::Secret);

impl Secret {
    /// A secret from bytes; [`Error::SecretTooShort`] if shorter than
    /// [`MIN_SECRET_LEN`](crate::MIN_SECRET_LEN).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Secret> {
        Secret::checked(bytes.into(), "the secret given")
    }

    fn checked(bytes: Vec<u8>, origin: &'static str) -> Result<Secret> {
        let len = bytes.len();
        // ipc-core's secret zeroes the bytes when it drops, a refused one included.
        ipc_core::tcp::Secret::from_bytes(bytes).map(Secret).map_err(|_| Error::SecretTooShort {
            origin,
            len,
            min: MIN_SECRET_LEN,
        })
    }

    /// The secret in `TQ_SECRET` ([`SECRET_ENV`](crate::SECRET_ENV)), its bytes taken as they
    /// are: [`Error::SecretNotSet`] where it is not set, [`Error::SecretTooShort`] where it holds
    /// too few bytes.
    pub fn from_env() -> Result<Secret> {
        use std::os::unix::ffi::OsStringExt;
        let value = std::env::var_os(SECRET_ENV).ok_or(Error::SecretNotSet { variable: SECRET_ENV })?;
        Secret::checked(value.into_vec(), SECRET_ENV)
    }

    /// The link's secret, for the transport.
    pub(crate) fn core(&self) -> &ipc_core::tcp::Secret {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
