//! Received memory stays with the process that received it ([`Local`]).

use std::mem::ManuallyDrop;
use std::ops::Deref;

/// A value that belongs to the process that made it: dropped there, forgotten in a child made by
/// `fork`.
///
/// Such a child inherits the Python objects that hold received memory (arrays, DLPack capsules,
/// torch tensors), but not the channel's threads. Dropping them there would release the parent's
/// messages over the parent's own connection: the sender would reuse memory the parent still
/// reads, and two processes writing one connection break it (an outside tester saw the parent's
/// channel end as if its sender had gone, 33 messages lost). The child forgets them instead; its
/// copy of the mappings goes with it.
pub struct Local<T> {
    pid: u32,
    value: ManuallyDrop<T>,
}

impl<T> Local<T> {
    pub fn new(value: T) -> Local<T> {
        Local { pid: std::process::id(), value: ManuallyDrop::new(value) }
    }
}

impl<T> Deref for Local<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Drop for Local<T> {
    fn drop(&mut self) {
        if self.pid == std::process::id() {
            // SAFETY: `value` is dropped once, here, and never used again.
            unsafe { ManuallyDrop::drop(&mut self.value) }
        }
    }
}
