//! The queue between a thread that decides NCCL transfers and the worker thread that owns the
//! communicator and issues them, for both halves of [`Route::Nccl`](super::Route::Nccl) (the
//! sender's in `network.rs`, the receiver's in `channel/remote.rs`).
//!
//! NCCL may wait inside a call (a set-up, a connection a transfer needs, until the other rank
//! takes part), so only the worker ever calls it: `send` and `recv` queue a job and go on, and
//! nothing a peer does can hold them up.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::sync::lock;

/// Jobs for one worker, in order.
pub(crate) struct WorkQueue<J> {
    state: Mutex<State<J>>,
    wake: Condvar,
}

struct State<J> {
    jobs: VecDeque<J>,
    /// No more jobs come: the worker does those queued, then ends.
    closed: bool,
    /// The worker is to give up at once.
    aborted: bool,
    /// Why the worker gave up, once it did: later jobs are refused.
    failed: Option<String>,
}

/// What the worker is to do next.
pub(crate) enum Next<J> {
    Job(J),
    /// Closed, and every job done.
    Closed,
    Aborted,
}

impl<J> WorkQueue<J> {
    pub fn new() -> WorkQueue<J> {
        WorkQueue {
            state: Mutex::new(State { jobs: VecDeque::new(), closed: false, aborted: false, failed: None }),
            wake: Condvar::new(),
        }
    }

    /// Queues `job`; refused once the worker has given up.
    pub fn submit(&self, job: J) -> Result<()> {
        let mut state = lock(&self.state);
        if let Some(why) = &state.failed {
            return Err(Error::NcclFailed { why: why.clone() });
        }
        state.jobs.push_back(job);
        drop(state);
        self.wake.notify_one();
        Ok(())
    }

    /// For the worker: the next job, waiting for one.
    pub fn next(&self) -> Next<J> {
        let mut state = lock(&self.state);
        loop {
            if state.aborted {
                return Next::Aborted;
            }
            if let Some(job) = state.jobs.pop_front() {
                return Next::Job(job);
            }
            if state.closed {
                return Next::Closed;
            }
            state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// No more jobs come; with `abort`, the worker gives up those queued too.
    pub fn stop(&self, abort: bool) {
        let mut state = lock(&self.state);
        state.closed = true;
        state.aborted |= abort;
        drop(state);
        self.wake.notify_one();
    }

    /// For the worker: gives up, refusing later jobs with `why`; returns the jobs still queued.
    pub fn fail(&self, why: String) -> Vec<J> {
        let mut state = lock(&self.state);
        state.failed = Some(why);
        state.jobs.drain(..).collect()
    }
}

/// Worker threads to join before their owner goes: a process must not exit while one is inside
/// NCCL (NCCL's and the driver's teardown at exit would pull its state away).
#[derive(Default)]
pub(crate) struct Workers(Mutex<Vec<JoinHandle<()>>>);

impl Workers {
    /// Starts `work` on a thread named `name`.
    pub fn spawn(&self, name: &str, work: impl FnOnce() + Send + 'static) -> Result<()> {
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(work)
            .map_err(|source| ipc_core::Error::Os { what: "starting an NCCL worker thread", source })?;
        let mut all = lock(&self.0);
        all.retain(|h| !h.is_finished());
        all.push(handle);
        Ok(())
    }

    /// Waits for every worker (each ends once its queue is stopped; their waits are bounded).
    pub fn join(&self) {
        let handles: Vec<_> = lock(&self.0).drain(..).collect();
        for handle in handles {
            if handle.join().is_err() {
                tracing::warn!("an NCCL worker thread panicked");
            }
        }
    }
}
