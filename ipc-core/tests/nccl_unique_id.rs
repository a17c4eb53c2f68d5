//! A unique id from the pinned NCCL that `cargo xtask setup` installs: NCCL makes one without a
//! GPU. One test in its own binary, as it points `TQ_NCCL_LIBRARY` at that library first.

use std::path::Path;

use ipc_core::nccl::UniqueId;

#[test]
fn nccl_makes_unique_ids_without_a_gpu() {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.toolchain/venv/lib");
    let pinned = std::fs::read_dir(lib).ok().and_then(|entries| {
        entries
            .flatten()
            .map(|entry| entry.path().join("site-packages").join(cuda_sys::nccl::WHEEL_LIBRARY))
            .find(|path| path.is_file())
    });
    let Some(pinned) = pinned else {
        eprintln!("skipped: no pinned NCCL under .toolchain (run `cargo xtask setup`)");
        return;
    };
    // SAFETY: this binary runs this one test; no other thread reads or writes the environment.
    unsafe { std::env::set_var(cuda_sys::nccl::LIBRARY_ENV, &pinned) };
    let found = cuda_sys::nccl::library().expect("the pinned NCCL loads");
    assert_eq!(found.path(), pinned);
    let (first, second) = (UniqueId::new().expect("an id"), UniqueId::new().expect("an id"));
    assert_ne!(first.to_bytes(), [0; UniqueId::LEN]);
    assert_ne!(first.to_bytes(), second.to_bytes(), "each id is a fresh rendezvous");
    assert_eq!(UniqueId::from_bytes(first.to_bytes()).to_bytes(), first.to_bytes());
}
