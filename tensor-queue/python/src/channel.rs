//! `Sender`, `Receiver` and `Broadcast` for Python: the Rust channels carrying [`Value`]s.
//!
//! Every wait releases the GIL and runs in slices, checking for signals between them, so that
//! Ctrl-C interrupts a blocked `recv` or `send`. Each object records the process that opened it:
//! used in a child made by `fork` it raises `UsedAfterFork` (the channel's threads and sockets
//! belong to the parent), and such a child drops it without touching the parent's state.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_sys::CUstream;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tensor_queue::{Error, MessageInfo, Stream};

use crate::dlpack::SendOrder;
use crate::errors::{raise, to_py};
use crate::stats;
use crate::value::{Value, count_arrays, decode, encode};

/// How long one wait runs before the GIL is taken back to check for signals.
const SLICE: Duration = Duration::from_millis(50);

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// `seconds` as a duration: any finite number >= 0, one too large for a `Duration` (1e20) meaning
/// as long as one can be (it was refused as "not finite", after `Queue.put` had waited with it).
fn duration(seconds: f64, what: &str) -> PyResult<Duration> {
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(raise("InvalidArgument", format!("{what} must be a finite number of seconds >= 0, not {seconds}")));
    }
    Ok(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
}

/// When `seconds` from now is (see [`duration`]; the furthest a clock can say, for a huge one).
fn deadline_in(seconds: f64, what: &str) -> PyResult<Instant> {
    Ok(ipc_core::deadline::deadline(duration(seconds, what)?))
}

/// An end that belongs to the process that opened it.
struct Owned<T> {
    pid: u32,
    inner: Option<T>,
}

impl<T> Owned<T> {
    fn new(inner: T) -> Owned<T> {
        Owned { pid: std::process::id(), inner: Some(inner) }
    }

    fn get(&mut self, what: &str) -> PyResult<&mut T> {
        if self.pid != std::process::id() {
            return Err(raise(
                "UsedAfterFork",
                format!(
                    "this {what} was opened by pid {} and this process (pid {}) is a fork of it: open a new one \
                     here (or start children with the 'spawn' or 'forkserver' method)",
                    self.pid,
                    std::process::id()
                ),
            ));
        }
        self.inner.as_mut().ok_or_else(|| raise("Closed", format!("this {what} is closed")))
    }

    /// Whether `close` was called (a wait in progress on a clone of the end gives up).
    fn is_closed(&self) -> bool {
        self.inner.is_none()
    }

    fn close(&mut self) {
        if let Some(inner) = self.inner.take() {
            if self.pid == std::process::id() {
                drop(inner);
            } else {
                // A forked child: the threads this would join live in the parent only.
                std::mem::forget(inner);
            }
        }
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        self.close();
    }
}

fn info_dict<'py>(py: Python<'py>, info: &MessageInfo) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("sender_pid", info.sender_pid)?;
    dict.set_item("connection", info.connection)?;
    dict.set_item("seq", info.seq)?;
    dict.set_item("sent_ns", info.sent_ns)?;
    dict.set_item("encoded_ns", info.encoded_ns)?;
    dict.set_item("arrived_ns", info.arrived_ns)?;
    dict.set_item("imported_ns", info.imported_ns)?;
    dict.set_item("taken_ns", info.taken_ns)?;
    dict.set_item("decoded_ns", info.decoded_ns)?;
    Ok(dict)
}

/// The receiving end: binds an address (a Unix socket path, or `tcp://host:port` with the
/// secret in `TQ_SECRET`); any number of senders connect to it.
#[pyclass(module = "tensor_queue._native", name = "Receiver", frozen)]
pub struct Receiver {
    end: Mutex<Owned<tensor_queue::Receiver<Value>>>,
    address: String,
}

impl Receiver {
    fn recv_inner(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<(Value, MessageInfo)> {
        let received =
            in_slices(py, timeout, |slice| Ok(lock(&self.end).get("Receiver")?.recv_with_info(Some(slice))))?;
        stats::MESSAGES_RECEIVED.add(1);
        Ok(received)
    }
}

#[pymethods]
impl Receiver {
    /// Binds `address`; `capacity` bounds the messages queued here (senders wait beyond it).
    #[staticmethod]
    #[pyo3(signature = (address, capacity = None))]
    fn bind(py: Python<'_>, address: String, capacity: Option<&Bound<'_, PyAny>>) -> PyResult<Receiver> {
        let capacity = match capacity {
            None => tensor_queue::DEFAULT_CAPACITY,
            // Any int the caller gives (a negative one, one beyond 32 bits) is a bad argument,
            // not a bare OverflowError.
            Some(given) => match given.extract::<u32>() {
                Ok(capacity) if capacity >= 1 => capacity,
                _ => {
                    let shown = given.repr().map(|r| r.to_string()).unwrap_or_default();
                    let most = u32::MAX;
                    return Err(raise(
                        "InvalidArgument",
                        format!("capacity {shown} is not a number of messages from 1 to {most}"),
                    ));
                }
            },
        };
        let receiver = py
            .detach(|| tensor_queue::Receiver::<Value>::bind_with_capacity(address.as_str(), capacity))
            .map_err(to_py)?;
        // `tcp://host:0` asks for any free port: the address senders need names the one taken.
        let address = match receiver.local_addr() {
            Some(bound) => format!("tcp://{bound}"),
            None => address,
        };
        Ok(Receiver { end: Mutex::new(Owned::new(receiver)), address })
    }

    /// The address it was bound to.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// The next message; waits up to `timeout` seconds (`None`: until one comes). Raises
    /// `Disconnected` once every sender has gone and everything they sent was received, and
    /// `Timeout` when the time passes.
    #[pyo3(signature = (timeout = None))]
    fn recv<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyAny>> {
        let (value, _) = self.recv_inner(py, timeout)?;
        decode(py, value)
    }

    /// The next message if one is waiting, else raises `Empty`.
    fn try_recv<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let got = py.detach(|| -> PyResult<Result<Value, Error>> {
            let mut end = lock(&self.end);
            Ok(end.get("Receiver")?.try_recv())
        })?;
        let value = got.map_err(to_py)?;
        stats::MESSAGES_RECEIVED.add(1);
        decode(py, value)
    }

    /// The next message and a dict of who sent it and when each stage of its hand-off happened
    /// (`sender_pid`; `connection`, which tells apart two senders of one process; `seq`, counted
    /// per connection; `sent_ns`, `encoded_ns`, `arrived_ns`, `imported_ns`, `taken_ns`, `decoded_ns`).
    #[pyo3(signature = (timeout = None))]
    fn recv_with_info<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyDict>)> {
        let (value, info) = self.recv_inner(py, timeout)?;
        Ok((decode(py, value)?, info_dict(py, &info)?))
    }

    /// How long `recv` spins before it sleeps (seconds; spinning trades a core for latency).
    fn set_spin(&self, seconds: f64) -> PyResult<()> {
        let spin = duration(seconds, "spin")?;
        lock(&self.end).get("Receiver")?.set_spin(spin);
        Ok(())
    }

    /// Makes iteration (and `recv`'s `Disconnected`) wait until `count` senders have joined.
    fn expect_senders(&self, count: &Bound<'_, PyAny>) -> PyResult<()> {
        let count = count.extract::<usize>().map_err(|_| {
            let shown = count.repr().map(|r| r.to_string()).unwrap_or_default();
            raise("InvalidArgument", format!("expect_senders({shown}): a number of senders, 0 or more"))
        })?;
        lock(&self.end).get("Receiver")?.expect_senders(count);
        Ok(())
    }

    /// Errors of connections the receiver closed (each a string) since the last call.
    fn take_errors(&self) -> PyResult<Vec<String>> {
        Ok(lock(&self.end).get("Receiver")?.take_errors().iter().map(ToString::to_string).collect())
    }

    /// Closes the receiver (senders see `Disconnected`); arrays already received stay valid.
    fn close(&self, py: Python<'_>) {
        py.detach(|| lock(&self.end).close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Messages until every sender has gone.
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self.recv_inner(py, None) {
            Ok((value, _)) => Ok(Some(decode(py, value)?)),
            Err(error) if is_disconnected(py, &error) => Ok(None),
            Err(error) => Err(error),
        }
    }
}

fn is_disconnected(py: Python<'_>, error: &PyErr) -> bool {
    py.import("tensor_queue._errors")
        .and_then(|m| m.getattr("Disconnected"))
        .is_ok_and(|class| error.get_type(py).is(&class))
}

/// The sending end: connects to a receiver's address.
#[pyclass(module = "tensor_queue._native", name = "Sender", frozen)]
pub struct Sender {
    end: Mutex<Owned<tensor_queue::Sender<Value>>>,
    address: String,
}

impl Sender {
    fn inner(&self) -> PyResult<tensor_queue::Sender<Value>> {
        Ok(lock(&self.end).get("Sender")?.clone())
    }
}

/// The options every `send` takes: `stream` (a `torch.cuda.Stream`, or a raw `CUstream` as an
/// int) to order GPU arrays after instead of torch's current stream, and `copy` (`"auto"`, or
/// `"never"` to refuse arrays that would be copied).
fn send_order(stream: Option<&Bound<'_, PyAny>>, copy: &str) -> PyResult<SendOrder> {
    let explicit = match stream {
        None => None,
        Some(s) if s.is_none() => None,
        Some(s) => {
            let raw: usize = match s.getattr("cuda_stream") {
                Ok(raw) => raw.extract()?,
                Err(_) => s.extract()?,
            };
            Some(raw as CUstream)
        }
    };
    let never_copy = match copy {
        "auto" => false,
        "never" => true,
        other => return Err(raise("InvalidArgument", format!("copy must be \"auto\" or \"never\", not {other:?}"))),
    };
    Ok(SendOrder::new(explicit, never_copy))
}

/// The stream a message's GPU copies were queued on, to send it ordered after them; a message
/// with copies on several GPUs waits for them all here instead.
fn copies_stream(order: &SendOrder) -> PyResult<Option<&Stream>> {
    match order.devices.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(&one.stream)),
        several => {
            for device in several {
                device.stream.synchronize().map_err(|e| to_py(Error::Core(e)))?;
            }
            Ok(None)
        }
    }
}

/// Sends `message` by `send` (one sender, or each of a broadcast's) in slices, checking signals.
/// `closed` says whether the end was closed meanwhile (by another thread): the send then gives up
/// with `Closed` at the end of its slice, having sent nothing (it waited on a clone of the end,
/// which `close` alone did not wake; outside tester, Python round 9, finding 2).
fn send_in_slices(
    py: Python<'_>,
    message: &Bound<'_, PyAny>,
    timeout: Option<f64>,
    mut order: SendOrder,
    send: impl Fn(&Value, Option<&Stream>, Duration) -> Result<(), Error> + Sync,
    closed: impl Fn() -> Option<PyErr> + Sync,
    receivers: u64,
) -> PyResult<()> {
    if let Some(seconds) = timeout {
        duration(seconds, "timeout")?; // a bad timeout is refused before any array is copied
    }
    let value = encode(message, &mut order)?;
    let stream = copies_stream(&order)?;
    // A slice that times out sent nothing: the receiver's queue stayed full through it.
    in_slices(py, timeout, |slice| match closed() {
        Some(error) => Err(error),
        None => Ok(send(&value, stream, slice)),
    })?;
    stats::MESSAGES_SENT.add(receivers);
    stats::ARRAYS_SENT.add(count_arrays(&value) * receivers);
    Ok(())
}

/// Whether a send that may not wait is refused now, before its arrays are copied into channel
/// memory (a refused try copied the whole message; outside testers, Python round 9): some
/// receiver has no room, and is still connected (a gone one's error comes from the send).
fn full_now(senders: &[tensor_queue::Sender<Value>]) -> bool {
    senders.iter().any(|s| !s.has_room() && s.is_connected())
}

/// `Closed` if `end` was closed.
fn closed_error<T>(end: &Mutex<Owned<T>>, what: &str) -> Option<PyErr> {
    lock(end)
        .is_closed()
        .then(|| raise("Closed", format!("this {what} was closed while send waited; nothing was sent")))
}

/// Runs `attempt` without the GIL in slices of at most [`SLICE`] until it answers anything but
/// `Error::Timeout` or `timeout` seconds (`None`: no bound) have passed, checking for Ctrl-C
/// between slices.
fn in_slices<T: Send>(
    py: Python<'_>,
    timeout: Option<f64>,
    attempt: impl Fn(Duration) -> PyResult<Result<T, Error>> + Sync,
) -> PyResult<T> {
    let deadline = match timeout {
        Some(t) => Some(deadline_in(t, "timeout")?),
        None => None,
    };
    loop {
        let slice = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLICE));
        match py.detach(|| attempt(slice))? {
            Ok(done) => return Ok(done),
            Err(Error::Timeout) => {
                py.check_signals()?;
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(to_py(Error::Timeout));
                }
            }
            Err(other) => return Err(to_py(other)),
        }
    }
}

#[pymethods]
impl Sender {
    /// Connects to the receiver at `address` and waits for its greeting (the credits of its
    /// queue), up to `timeout` seconds in all: so a `try_send` right after says `Full` only when
    /// the receiver's queue is full, not because its greeting is still on the way.
    ///
    /// `inline_gpu_up_to`: across hosts, a message whose GPU arrays total at most this many
    /// bytes sends them inline over TCP instead of through NCCL (0: always NCCL; default:
    /// `TQ_INLINE_GPU_UP_TO`, else 64 KiB). Too large a value raises `ValueError`.
    #[staticmethod]
    #[pyo3(signature = (address, timeout = 10.0, *, inline_gpu_up_to = None))]
    fn connect(py: Python<'_>, address: String, timeout: f64, inline_gpu_up_to: Option<u64>) -> PyResult<Sender> {
        let timeout = duration(timeout, "timeout")?;
        let mut builder = tensor_queue::Sender::<Value>::builder().timeout(timeout);
        if let Some(bytes) = inline_gpu_up_to {
            builder = builder.inline_gpu_up_to(bytes);
        }
        let sender = py
            .detach(|| {
                let started = Instant::now();
                let sender = builder.connect(address.as_str())?;
                sender.wait_ready(timeout.saturating_sub(started.elapsed()))?;
                Ok(sender)
            })
            .map_err(to_py)?;
        Ok(Sender { end: Mutex::new(Owned::new(sender)), address })
    }

    /// The address it connected to.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// The threshold of small messages across hosts (see `connect`'s `inline_gpu_up_to`).
    #[getter]
    fn inline_gpu_up_to(&self) -> PyResult<u64> {
        Ok(self.inner()?.inline_gpu_up_to())
    }

    /// The route an array on CUDA device `device` (an ordinal of this process) takes to the
    /// receiver, in a message whose GPU arrays total `gpu_bytes` (`None`: as the pair of GPUs
    /// usually goes; across hosts a small message goes inline over TCP). Waits up to `timeout`
    /// seconds for the receiver's greeting. A dict: `route` (its name: `SameDevice`, `PeerMap`,
    /// `PeerCopy`, `Staged`, `Host`, `Nccl` or `Tcp`), `description` (in words), `target` (the
    /// receiver's GPU UUID, `None` for host memory), `slower_because` and `reason` (`None` or
    /// why). Without a CUDA device `device`, raises `InvalidArgument` (a `ValueError`).
    #[pyo3(signature = (device, gpu_bytes = None, timeout = 10.0))]
    fn route<'py>(
        &self,
        py: Python<'py>,
        device: i32,
        gpu_bytes: Option<u64>,
        timeout: f64,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let sender = self.inner()?;
        let timeout = duration(timeout, "timeout")?;
        let choice = py
            .detach(|| {
                let source = ipc_core::Device::get(device)
                    .and_then(|d| d.uuid())
                    .map_err(|e| Error::Invalid(format!("CUDA device {device}: {e}")))?;
                match gpu_bytes {
                    Some(bytes) => sender.route_for(&source, bytes, timeout),
                    None => sender.route(&source, timeout),
                }
            })
            .map_err(to_py)?;
        let dict = pyo3::types::PyDict::new(py);
        dict.set_item("route", format!("{:?}", choice.route))?;
        dict.set_item("description", choice.route.to_string())?;
        dict.set_item("target", choice.target.map(|uuid| uuid.to_string()))?;
        dict.set_item("slower_because", choice.slower_because)?;
        dict.set_item("reason", choice.reason)?;
        Ok(dict)
    }

    /// Sends `message`, waiting (up to `timeout` seconds) while the receiver's queue is full.
    /// Raises `NotSendable` (a `TypeError`) naming where a value that cannot be carried sits.
    /// GPU arrays are ordered after `stream` (default: torch's current stream); `copy="never"`
    /// refuses arrays that would be copied.
    #[pyo3(signature = (message, timeout = None, *, stream = None, copy = "auto"))]
    fn send(
        &self,
        py: Python<'_>,
        message: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
        copy: &str,
    ) -> PyResult<()> {
        let sender = self.inner()?;
        if timeout == Some(0.0) && full_now(std::slice::from_ref(&sender)) {
            return Err(to_py(Error::Timeout)); // as `try_send`: nothing copied to be refused
        }
        let order = send_order(stream, copy)?;
        send_in_slices(
            py,
            message,
            timeout,
            order,
            |value, stream, slice| match stream {
                Some(stream) => sender.send_on_timeout(value, stream, slice),
                None => sender.send_timeout(value, slice),
            },
            || closed_error(&self.end, "Sender"),
            1,
        )
    }

    /// Sends `message` if the receiver's queue has room now, else raises `Full`.
    fn try_send(&self, py: Python<'_>, message: &Bound<'_, PyAny>) -> PyResult<()> {
        let sender = self.inner()?;
        if full_now(std::slice::from_ref(&sender)) {
            return Err(to_py(Error::Full));
        }
        let mut order = SendOrder::default();
        let value = encode(message, &mut order)?;
        // No stream-ordered variant: the copies are waited for.
        for device in &order.devices {
            device.stream.synchronize().map_err(|e| to_py(Error::Core(e)))?;
        }
        py.detach(|| sender.try_send(&value)).map_err(to_py)?;
        stats::MESSAGES_SENT.add(1);
        stats::ARRAYS_SENT.add(count_arrays(&value));
        Ok(())
    }

    /// How many arrays this sender sent that the receiver still holds.
    fn outstanding(&self) -> PyResult<usize> {
        Ok(self.inner()?.outstanding_leases())
    }

    /// Waits up to `timeout` seconds until the receiver holds none of this sender's arrays.
    fn wait_released(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let sender = self.inner()?;
        let deadline = deadline_in(timeout, "timeout")?;
        loop {
            let slice = deadline.saturating_duration_since(Instant::now()).min(SLICE);
            if py.detach(|| sender.wait_released(slice)) {
                return Ok(true);
            }
            py.check_signals()?;
            if Instant::now() >= deadline {
                return Ok(false);
            }
        }
    }

    /// Whether the receiver is still there.
    fn is_connected(&self) -> PyResult<bool> {
        Ok(self.inner()?.is_connected())
    }

    /// The receiver's process id.
    #[getter]
    fn peer_pid(&self) -> PyResult<u32> {
        Ok(self.inner()?.peer_pid())
    }

    /// Messages the receiver refused since the last call (each a string saying why).
    fn take_rejected(&self) -> PyResult<Vec<String>> {
        Ok(self.inner()?.take_rejected().iter().map(|r| format!("{r:?}")).collect())
    }

    /// Closes this end (the receiver sees it go once every clone is closed). Waits, while the
    /// receiver lives, until the bytes of what was sent are in its socket; Ctrl-C interrupts
    /// that wait (the end stays open).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        // The Rust end waits for the same without a bound when dropped: wait here in slices
        // first, so that a receiver that never reads cannot make close() deaf to Ctrl-C.
        if let Ok(sender) = self.inner() {
            while !py.detach(|| sender.wait_written(SLICE)) {
                py.check_signals()?;
            }
        }
        py.detach(|| lock(&self.end).close());
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py)
    }
}

/// One message to many receivers: each array is copied into channel memory once and every
/// receiver maps the same memory.
#[pyclass(module = "tensor_queue._native", name = "Broadcast", frozen)]
pub struct Broadcast {
    end: Mutex<Owned<tensor_queue::Broadcast<Value>>>,
}

impl Broadcast {
    fn senders(&self) -> PyResult<Vec<tensor_queue::Sender<Value>>> {
        Ok(lock(&self.end).get("Broadcast")?.senders().to_vec())
    }
}

#[pymethods]
impl Broadcast {
    /// A broadcast over these senders (one per receiver; they stay usable on their own).
    #[new]
    fn new(senders: &Bound<'_, PyList>) -> PyResult<Broadcast> {
        let mut inner = Vec::with_capacity(senders.len());
        for sender in senders.iter() {
            inner.push(sender.cast::<Sender>()?.get().inner()?);
        }
        Ok(Broadcast { end: Mutex::new(Owned::new(tensor_queue::Broadcast::new(inner))) })
    }

    /// Sends `message` to every receiver (the same memory for all), waiting (up to `timeout`
    /// seconds: then `Timeout`, and no receiver got it) while any receiver's queue is full;
    /// `stream` and `copy` as for `Sender.send`. A receiver that is gone is skipped: the others
    /// get the message, and then the first such error is raised (`Disconnected`), so sending
    /// the message again would repeat it to them; make a new `Broadcast` without the gone one
    /// (`outstanding()` and each `Sender.is_connected()` tell which).
    #[pyo3(signature = (message, timeout = None, *, stream = None, copy = "auto"))]
    fn send(
        &self,
        py: Python<'_>,
        message: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
        copy: &str,
    ) -> PyResult<()> {
        let broadcast = tensor_queue::Broadcast::new(self.senders()?);
        if timeout == Some(0.0) && full_now(broadcast.senders()) {
            return Err(to_py(Error::Timeout)); // all or none: one full receiver refuses it
        }
        let receivers = broadcast.senders().len() as u64;
        let order = send_order(stream, copy)?;
        // In slices, all or none each (so that Ctrl-C interrupts a wait for a full receiver).
        send_in_slices(
            py,
            message,
            timeout,
            order,
            |value, stream, slice| match stream {
                Some(stream) => broadcast.send_on_timeout(value, stream, slice),
                None => broadcast.send_timeout(value, slice),
            },
            || closed_error(&self.end, "Broadcast"),
            receivers,
        )
    }

    /// Lets go of the senders this broadcast holds (each `Sender` given to it stays open until
    /// it is closed too); a `send` waiting in another thread raises `Closed`.
    fn close(&self, py: Python<'_>) {
        py.detach(|| lock(&self.end).close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    /// For each receiver, how many of the arrays sent it still holds.
    fn outstanding(&self) -> PyResult<Vec<usize>> {
        Ok(self.senders()?.iter().map(|s| s.outstanding_leases()).collect())
    }

    /// Waits up to `timeout` seconds until no receiver holds any array sent here.
    fn wait_released(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let senders = self.senders()?;
        let deadline = deadline_in(timeout, "timeout")?;
        loop {
            let slice = deadline.saturating_duration_since(Instant::now()).min(SLICE);
            if py.detach(|| senders.iter().all(|s| s.wait_released(slice))) {
                return Ok(true);
            }
            py.check_signals()?;
            if Instant::now() >= deadline {
                return Ok(false);
            }
        }
    }
}
