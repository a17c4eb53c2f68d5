//! Across hosts, small messages skip NCCL: the one decision of whether a message's GPU tensors
//! travel inline in its TCP frame ([`Route::Tcp`], copied to the sender's host, then onto the
//! receiver's GPU) rather than through an NCCL send/receive pair ([`Route::Nccl`]).
//!
//! # Why a threshold
//! An NCCL transfer pays a fixed cost per message (about 75 us a side: a send/receive pair, its
//! proxy thread's progress, a kernel), whatever its size; an inline tensor pays a device-to-host
//! copy at the sender and a host-to-device copy at the receiver (about 10-20 us a side for a
//! small tensor) and then its bytes at the copies' speed. Below some size the copies win; above
//! it NCCL does. The default, [`DEFAULT_INLINE_GPU_UP_TO`] (64 KiB), is well inside the copies'
//! side on the machines measured (a pageable 64 KiB device-to-host copy costs well under the
//! fixed cost of an NCCL pair); `tq doctor --measure` reports the crossover this machine
//! suggests. The decision is per message, all or none of its GPU tensors, so that a message's
//! frames and transfers stay in one simple order.
//!
//! Set per sender with [`SenderBuilder::inline_gpu_up_to`](crate::SenderBuilder::inline_gpu_up_to)
//! (0: always NCCL), or for a whole process with [`INLINE_GPU_ENV`] (benchmarks).

use super::Route;
use super::choose::Choice;
use super::policy::Strictness;

/// A message whose GPU tensors' bytes total at most this travels without NCCL by default.
///
/// ```
/// assert_eq!(tensor_queue::route::DEFAULT_INLINE_GPU_UP_TO, 64 << 10);
/// ```
pub const DEFAULT_INLINE_GPU_UP_TO: u64 = 64 << 10;

/// The environment variable that sets, in bytes, the default of
/// [`SenderBuilder::inline_gpu_up_to`](crate::SenderBuilder::inline_gpu_up_to) for the senders of
/// this process (`0`: always NCCL). Read when a sender connects; a value that is not a number of
/// bytes within [`MAX_INLINE_GPU_UP_TO`] makes `connect` fail with `Error::Invalid`.
pub const INLINE_GPU_ENV: &str = "TQ_INLINE_GPU_UP_TO";

/// The largest threshold accepted: a message's inline bytes must fit one bulk run of its frame
/// (`wire::MAX_INLINE_BYTES`, which the wire checks is the same).
pub const MAX_INLINE_GPU_UP_TO: u64 = 4 << 30;

/// A threshold refused by [`inline_threshold`] (`connect` reports it as `Error::Invalid`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadThreshold(pub String);

/// What a receiver reports as the reason of a message's GPU tensors that travelled inline.
pub const SMALL_MESSAGE_INLINE: &str = "small message inline";

/// The threshold a sender uses: `given` (a builder's), else [`INLINE_GPU_ENV`]'s value, else
/// [`DEFAULT_INLINE_GPU_UP_TO`]; refused ([`BadThreshold`]) above [`MAX_INLINE_GPU_UP_TO`]
/// or where the variable is not a number.
///
/// ```
/// use tensor_queue::route::{DEFAULT_INLINE_GPU_UP_TO, inline_threshold};
/// assert_eq!(inline_threshold(Some(0)).unwrap(), 0);
/// assert!(inline_threshold(Some(u64::MAX)).is_err());
/// # if std::env::var_os(tensor_queue::route::INLINE_GPU_ENV).is_none() {
/// assert_eq!(inline_threshold(None).unwrap(), DEFAULT_INLINE_GPU_UP_TO);
/// # }
/// ```
pub fn inline_threshold(given: Option<u64>) -> Result<u64, BadThreshold> {
    let from_env = || -> Result<Option<u64>, BadThreshold> {
        let Some(value) = std::env::var_os(INLINE_GPU_ENV) else { return Ok(None) };
        let text = value.to_string_lossy();
        text.trim().parse::<u64>().map(Some).map_err(|_| {
            BadThreshold(format!("{INLINE_GPU_ENV}={text:?}: expected a number of bytes (0: always NCCL)"))
        })
    };
    let (threshold, origin) = match given {
        Some(bytes) => (bytes, "inline_gpu_up_to"),
        None => match from_env()? {
            Some(bytes) => (bytes, INLINE_GPU_ENV),
            None => (DEFAULT_INLINE_GPU_UP_TO, "the default"),
        },
    };
    if threshold > MAX_INLINE_GPU_UP_TO {
        return Err(BadThreshold(format!(
            "{origin}: {threshold} bytes; at most {MAX_INLINE_GPU_UP_TO} (the most a message's bytes may hold)"
        )));
    }
    Ok(threshold)
}

/// Whether a message whose GPU tensors, all bound for NCCL, total `gpu_bytes` travels inline
/// with a sender's `threshold` and the receiver's `strict`ness: a receiver that refuses staging
/// through host memory ([`Strictness::NoStaging`]) keeps NCCL, whatever the size.
///
/// ```
/// use tensor_queue::route::{Strictness, inlines};
/// assert!(inlines(4096, 64 << 10, Strictness::Any));
/// assert!(inlines(64 << 10, 64 << 10, Strictness::Any)); // at most the threshold
/// assert!(!inlines((64 << 10) + 1, 64 << 10, Strictness::Any));
/// assert!(!inlines(1, 0, Strictness::Any)); // 0: always NCCL
/// assert!(!inlines(4096, 64 << 10, Strictness::NoStaging));
/// ```
pub fn inlines(gpu_bytes: u64, threshold: u64, strict: Strictness) -> bool {
    gpu_bytes > 0 && gpu_bytes <= threshold && strict == Strictness::Any
}

/// The route of a message's GPU tensors that travel inline: [`Route::Tcp`] onto `nccl`'s target,
/// with the reason [`SMALL_MESSAGE_INLINE`].
pub(crate) fn inline_choice(nccl: Choice) -> Choice {
    Choice { route: Route::Tcp, reason: Some(SMALL_MESSAGE_INLINE.into()), ..nccl }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_is_validated_and_given_wins() {
        assert_eq!(inline_threshold(Some(12345)).unwrap(), 12345);
        assert_eq!(inline_threshold(Some(MAX_INLINE_GPU_UP_TO)).unwrap(), MAX_INLINE_GPU_UP_TO);
        let error = inline_threshold(Some(MAX_INLINE_GPU_UP_TO + 1)).unwrap_err();
        assert!(error.0.contains("inline_gpu_up_to"), "{error}");
    }

    #[test]
    fn the_decision_is_all_or_nothing_by_the_total() {
        for strict in [Strictness::Any, Strictness::NoStaging, Strictness::ZeroCopy] {
            for (bytes, threshold) in [(0, 0), (0, 10), (1, 0), (10, 10), (11, 10), (1 << 20, 64 << 10)] {
                let inline = inlines(bytes, threshold, strict);
                assert_eq!(inline, strict == Strictness::Any && bytes > 0 && bytes <= threshold, "{bytes} {threshold}");
            }
        }
    }

    #[test]
    fn an_inline_choice_keeps_the_target_and_says_why() {
        let nccl =
            Choice { route: Route::Nccl, target: Some(ipc_core::Uuid([3; 16])), slower_because: None, reason: None };
        let inline = inline_choice(nccl.clone());
        assert_eq!((inline.route, inline.target), (Route::Tcp, nccl.target));
        assert_eq!(inline.reason.as_deref(), Some(SMALL_MESSAGE_INLINE));
    }
}
