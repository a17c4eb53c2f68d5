//! Switches for tests only, compiled in only with the `test-switches` feature: no environment
//! variable can turn ordering off in a program built without it.

#[cfg(feature = "test-switches")]
/// With the `test-switches` feature, when set to `1`: receivers skip the stream wait, so tests
/// can prove that the ordering they check is real (the seed test must fail with it).
pub const SKIP_ORDERING_ENV: &str = "TENSOR_QUEUE_TEST_SKIP_ORDERING";

#[cfg(feature = "test-switches")]
/// With the `test-switches` feature, when set to `1`: senders order GPU hand-offs with
/// interprocess events even where stream memory operations work, so tests can cover the fallback.
pub const FORCE_EVENTS_ENV: &str = "TENSOR_QUEUE_TEST_FORCE_EVENTS";

#[cfg(feature = "test-switches")]
fn switch(name: &str, cell: &std::sync::OnceLock<bool>) -> bool {
    *cell.get_or_init(|| std::env::var(name).as_deref() == Ok("1"))
}

/// Whether receivers skip the stream wait (tests only).
pub(crate) fn skip_ordering() -> bool {
    #[cfg(feature = "test-switches")]
    {
        static SKIP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        switch(SKIP_ORDERING_ENV, &SKIP)
    }
    #[cfg(not(feature = "test-switches"))]
    false
}

/// Whether senders use events where signal words would do (tests only).
pub(crate) fn force_events() -> bool {
    #[cfg(feature = "test-switches")]
    {
        static FORCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        switch(FORCE_EVENTS_ENV, &FORCE)
    }
    #[cfg(not(feature = "test-switches"))]
    false
}

#[cfg(feature = "test-switches")]
/// With the `test-switches` feature, when set to `1`: a sender whose link uses rings kills its
/// own process right after it pushed the marker of a frame on the socket, before the frame, so
/// tests can cover a producer that dies between the two (the receiver must end, not hang).
pub const DIE_AFTER_MARKER_ENV: &str = "TENSOR_QUEUE_TEST_DIE_AFTER_MARKER";

/// Whether a sender dies between a marker and its socket frame (tests only).
pub(crate) fn die_after_marker() -> bool {
    #[cfg(feature = "test-switches")]
    {
        static DIE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        switch(DIE_AFTER_MARKER_ENV, &DIE)
    }
    #[cfg(not(feature = "test-switches"))]
    false
}

/// When `1`, a receiver waits 300 ms between its `Hello` and its offer of rings (tests only):
/// a sender has sent its messages on the socket and gone by the time the offer is made.
#[cfg_attr(not(feature = "test-switches"), allow(dead_code))]
pub const LATE_RING_OFFER_ENV: &str = "TENSOR_QUEUE_TEST_LATE_RING_OFFER";

/// When `1`, a receiver waits 300 ms after accepting a connection before its `Hello` (tests
/// only): a sender that connected, sent its own `Hello` and died is gone by the greeting.
#[cfg_attr(not(feature = "test-switches"), allow(dead_code))]
pub const LATE_GREETING_ENV: &str = "TENSOR_QUEUE_TEST_LATE_GREETING";

/// How long a receiver waits before its `Hello` (tests only; see [`LATE_GREETING_ENV`]).
pub(crate) fn greeting_delay() -> Option<std::time::Duration> {
    #[cfg(feature = "test-switches")]
    {
        static LATE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        switch(LATE_GREETING_ENV, &LATE).then_some(std::time::Duration::from_millis(300))
    }
    #[cfg(not(feature = "test-switches"))]
    None
}

/// How long a receiver waits before its offer of rings (tests only; see [`LATE_RING_OFFER_ENV`]).
pub(crate) fn ring_offer_delay() -> Option<std::time::Duration> {
    #[cfg(feature = "test-switches")]
    {
        static LATE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        switch(LATE_RING_OFFER_ENV, &LATE).then_some(std::time::Duration::from_millis(300))
    }
    #[cfg(not(feature = "test-switches"))]
    None
}

/// With the `test-switches` feature, milliseconds that replace `SENDER_DROP_TIMEOUT` (tests
/// only): a test of the bound on a dropped sender's wait need not wait a minute.
#[cfg_attr(not(feature = "test-switches"), allow(dead_code))]
pub const DROP_TIMEOUT_MS_ENV: &str = "TENSOR_QUEUE_TEST_DROP_TIMEOUT_MS";

/// What replaces `SENDER_DROP_TIMEOUT`, if anything (tests only; see [`DROP_TIMEOUT_MS_ENV`]).
pub(crate) fn drop_timeout() -> Option<std::time::Duration> {
    #[cfg(feature = "test-switches")]
    {
        static SET: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
        SET.get_or_init(|| std::env::var(DROP_TIMEOUT_MS_ENV).ok().and_then(|ms| ms.parse().ok()))
            .map(std::time::Duration::from_millis)
    }
    #[cfg(not(feature = "test-switches"))]
    None
}
