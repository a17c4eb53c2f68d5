//! The arenas give idle memory back by themselves (host tensors; a test binary of its own, since
//! the idle release time is one setting per process).

use std::time::{Duration, Instant};

use tensor_queue::{DType, Tensor, memory};

/// Two chunks that fall idle one after the other both go back. The arenas' thread, asleep until
/// the first is due, is not woken for the second (it is due later): it must find it when it
/// looks again for the first.
#[test]
fn chunks_that_fall_idle_one_after_another_all_go_back() -> tensor_queue::Result<()> {
    memory::set_idle_release(Duration::from_millis(100));
    // A chunk is 64 MiB: each of these fills one.
    let first = Tensor::zeros(DType::U8, &[64 << 20])?;
    let second = Tensor::zeros(DType::U8, &[64 << 20])?;
    assert!(memory::usage().host_bytes >= 128 << 20, "two chunks: {:?}", memory::usage());
    drop(first);
    std::thread::sleep(Duration::from_millis(30));
    drop(second);
    let deadline = Instant::now() + Duration::from_secs(20);
    while memory::usage().host_bytes > 0 {
        assert!(Instant::now() < deadline, "an idle chunk stayed: {:?}", memory::usage());
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}
