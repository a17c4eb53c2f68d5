//! What `tests/tests/outside_round6.rs` and its second process `outside6-peer` share, written
//! from the public API only: the message, the ways an outside user waits for one (blocking,
//! timeout, `try_recv` polling, async, `Select`, the receiver's descriptor in a poll loop of
//! one's own, spinning), a seeded jitter of short sleeps, and the messages of many small host
//! tensors (views of one storage, of several, mixed dtypes, empty and strided views) with what
//! each must look like on arrival.

use std::time::Duration;

use tensor_queue::channel::Select;
use tensor_queue::{DType, Error, Receiver, Tensor};

/// `(sender, index, tensors)`.
pub type Msg = (u32, u64, Vec<Tensor>);

/// A small seeded generator (xorshift64*), so that a failing run can be replayed.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next value.
    pub fn draw(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value below `n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.draw() % n
    }

    /// Half the time, sleeps 0-200 us: where a lost wake-up hides.
    pub fn jitter(&mut self) {
        if self.below(2) == 0 {
            std::thread::sleep(Duration::from_micros(self.below(201)));
        }
    }
}

/// How the user waits for the next message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// `recv`.
    Block,
    /// `recv_timeout` with short random timeouts, again after each `Timeout`.
    Timeout,
    /// A random number of `try_recv` polls, then a short `recv_timeout`, in turn.
    Try,
    /// `recv_async` on a runtime of the caller's.
    Async,
    /// `Select` over every receiver, then `try_recv` on the ready one.
    Select,
    /// `poll(2)` on the receivers' descriptors (`AsFd`), then `try_recv`.
    Poll,
    /// `recv` with `set_spin` of a random 0-50 us.
    Spin,
    /// `recv_async` under a random 1-500 us `tokio::time::timeout`, again after each: the
    /// future is dropped (cancelled) mid-wait, over and over.
    AsyncCancel,
}

impl Way {
    /// Every way.
    pub const ALL: [Way; 8] =
        [Way::Block, Way::Timeout, Way::Try, Way::Async, Way::Select, Way::Poll, Way::Spin, Way::AsyncCancel];

    /// Its name on a command line.
    pub fn name(self) -> &'static str {
        match self {
            Way::Block => "block",
            Way::Timeout => "timeout",
            Way::Try => "try",
            Way::Async => "async",
            Way::Select => "select",
            Way::Poll => "poll",
            Way::Spin => "spin",
            Way::AsyncCancel => "async-cancel",
        }
    }

    /// The way named `name`.
    pub fn parse(name: &str) -> Option<Way> {
        Way::ALL.into_iter().find(|w| w.name() == name)
    }

    /// Whether this way waits on several receivers at once (the tests then give it two).
    pub fn several(self) -> bool {
        matches!(self, Way::Select | Way::Poll)
    }
}

/// One or more receivers and a way of waiting on them; `next` is the next message of any, or
/// `Disconnected` once every one has ended.
pub struct Waiter {
    way: Way,
    receivers: Vec<Receiver<Msg>>,
    open: Vec<bool>,
    select: Option<(Select, Vec<usize>)>,
    runtime: Option<tokio::runtime::Runtime>,
    rng: Rng,
    /// How often the wait ended without a message (`Timeout`, `Empty` after a wake-up).
    pub idle: u64,
}

impl Waiter {
    /// Waits on `receivers` in `way`, its random choices seeded by `seed`.
    pub fn new(way: Way, mut receivers: Vec<Receiver<Msg>>, seed: u64) -> tensor_queue::Result<Waiter> {
        let mut rng = Rng::new(seed);
        if way == Way::Spin {
            for r in &mut receivers {
                r.set_spin(Duration::from_micros(rng.below(51)));
            }
        }
        let select = if way == Way::Select {
            let mut select = Select::new();
            let mut indices = Vec::new();
            for r in &receivers {
                indices.push(select.add(r)?);
            }
            Some((select, indices))
        } else {
            None
        };
        let runtime = matches!(way, Way::Async | Way::AsyncCancel)
            .then(|| tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime"));
        let open = vec![true; receivers.len()];
        Ok(Waiter { way, receivers, open, select, runtime, rng, idle: 0 })
    }

    /// The receivers, for whatever else the caller does with them.
    pub fn receivers(&mut self) -> &mut [Receiver<Msg>] {
        &mut self.receivers
    }

    /// The next message, or an error about one message, or `Disconnected` once all ended.
    pub fn wait(&mut self) -> tensor_queue::Result<Msg> {
        match self.way {
            Way::Block | Way::Spin => self.first_open(|r, _| r.recv()),
            Way::Timeout => loop {
                let timeout = Duration::from_micros(self.rng.below(2000) + 1);
                match self.first_open(|r, _| r.recv_timeout(timeout)) {
                    Err(Error::Timeout) => self.idle += 1,
                    other => return other,
                }
            },
            Way::Try => loop {
                for _ in 0..self.rng.below(50) {
                    match self.first_open(|r, _| r.try_recv()) {
                        Err(Error::Empty) => std::hint::spin_loop(),
                        other => return other,
                    }
                }
                let timeout = Duration::from_micros(self.rng.below(500) + 1);
                match self.first_open(|r, _| r.recv_timeout(timeout)) {
                    Err(Error::Timeout) => self.idle += 1,
                    other => return other,
                }
            },
            Way::Async => {
                let runtime = self.runtime.as_ref().expect("made for Async");
                let receivers = &mut self.receivers;
                let open = &mut self.open;
                let i = open.iter().position(|&o| o).ok_or(Error::Disconnected)?;
                let got = runtime.block_on(receivers[i].recv_async());
                if matches!(got, Err(Error::Disconnected)) {
                    open[i] = false;
                    return self.wait();
                }
                got
            }
            Way::AsyncCancel => loop {
                let runtime = self.runtime.as_ref().expect("made for AsyncCancel");
                let i = self.open.iter().position(|&o| o).ok_or(Error::Disconnected)?;
                let bound = Duration::from_micros(self.rng.below(500) + 1);
                let receiver = &mut self.receivers[i];
                match runtime.block_on(async { tokio::time::timeout(bound, receiver.recv_async()).await }) {
                    Err(_elapsed) => self.idle += 1,
                    Ok(Err(Error::Disconnected)) => self.open[i] = false,
                    Ok(got) => return got,
                }
            },
            Way::Select => loop {
                let (select, indices) = self.select.as_mut().expect("made for Select");
                let ready = select.ready()?;
                let i = indices.iter().position(|&x| x == ready).expect("an index Select gave");
                match self.receivers[i].try_recv() {
                    Err(Error::Empty) => self.idle += 1,
                    Err(Error::Disconnected) => {
                        select.remove(ready);
                        self.open[i] = false;
                        if !self.open.iter().any(|&o| o) {
                            return Err(Error::Disconnected);
                        }
                    }
                    other => return other,
                }
            },
            Way::Poll => loop {
                use rustix::event::{PollFd, PollFlags, poll};
                let live: Vec<usize> = (0..self.receivers.len()).filter(|&i| self.open[i]).collect();
                if live.is_empty() {
                    return Err(Error::Disconnected);
                }
                let readable: Vec<usize> = {
                    let mut fds: Vec<PollFd<'_>> =
                        live.iter().map(|&i| PollFd::new(&self.receivers[i], PollFlags::IN)).collect();
                    poll(&mut fds, None).expect("poll(2) on the receivers' descriptors");
                    live.iter().zip(&fds).filter(|(_, fd)| !fd.revents().is_empty()).map(|(&i, _)| i).collect()
                };
                for i in readable {
                    match self.receivers[i].try_recv() {
                        Err(Error::Empty) => self.idle += 1,
                        Err(Error::Disconnected) => self.open[i] = false,
                        other => return other,
                    }
                }
            },
        }
    }

    /// `f` on the first receiver still open; its `Disconnected` closes it and goes on to the
    /// next (for the ways that wait on one receiver at a time).
    fn first_open(
        &mut self,
        mut f: impl FnMut(&mut Receiver<Msg>, usize) -> tensor_queue::Result<Msg>,
    ) -> tensor_queue::Result<Msg> {
        loop {
            let i = self.open.iter().position(|&o| o).ok_or(Error::Disconnected)?;
            match f(&mut self.receivers[i], i) {
                Err(Error::Disconnected) => self.open[i] = false,
                other => return other,
            }
        }
    }
}

/// The layouts of the many-tensor messages: message `index` uses `layout(index)`.
pub const LAYOUTS: u64 = 5;

/// What a received tensor must be: dtype, shape, strides and its elements' bytes in order.
#[derive(Debug, PartialEq, Eq)]
pub struct Expected {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Strides in elements.
    pub strides: Vec<i64>,
    /// `Tensor::to_bytes` of it.
    pub bytes: Vec<u8>,
}

impl Expected {
    /// What `tensor` is now.
    pub fn of(tensor: &Tensor) -> tensor_queue::Result<Expected> {
        Ok(Expected {
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            strides: tensor.strides().to_vec(),
            bytes: tensor.to_bytes()?,
        })
    }
}

/// Bytes that tell message `index` and position `k` apart.
fn bytes_of(index: u64, k: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((i * 131 + k * 7 + index * 13) % 251) as u8 ^ 0x5a).collect()
}

/// Values of `dtype` that are valid as such (a bool is 0 or 1; floats no NaNs, whose bits may
/// change).
fn valid_bytes(dtype: DType, index: u64, k: u64, elements: usize) -> Vec<u8> {
    let raw = bytes_of(index, k, elements * dtype.size());
    match dtype {
        DType::Bool => raw.iter().map(|b| b & 1).collect(),
        // Small integers as floats: no NaN, no infinities, exact.
        DType::F16 => (0..elements).flat_map(|i| half::f16::from_f32((raw[i] % 100) as f32).to_le_bytes()).collect(),
        DType::BF16 => (0..elements).flat_map(|i| half::bf16::from_f32((raw[i] % 100) as f32).to_le_bytes()).collect(),
        DType::F32 => (0..elements).flat_map(|i| (raw[i] as f32 - 100.0).to_le_bytes()).collect(),
        DType::F64 => (0..elements).flat_map(|i| (raw[i] as f64 * 0.5).to_le_bytes()).collect(),
        _ => raw,
    }
}

/// The `n` tensors of message `index`, in layout `index % LAYOUTS`:
/// 0. views of one storage at regular offsets (`narrow`);
/// 1. views of sixteen storages, interleaved;
/// 2. one tensor each, of every dtype in turn, 1 to 9 elements;
/// 3. every third tensor has no element (shape `[0]`, a `narrow` of length 0, `[3, 0]`);
/// 4. strided views of one storage: transposes, a column (`select`), `flip`, `expand` (stride 0).
pub fn many_tensors(index: u64, n: usize) -> tensor_queue::Result<Vec<Tensor>> {
    let n64 = n as u64;
    match index % LAYOUTS {
        0 => {
            let base = Tensor::from_bytes(&valid_bytes(DType::F32, index, 0, n * 8), DType::F32, &[n64 * 8])?;
            (0..n64).map(|k| base.narrow(0, k * 8, 8)).collect()
        }
        1 => {
            let per = n64.div_ceil(16) * 4;
            let storages: Vec<Tensor> = (0..16)
                .map(|s| Tensor::from_bytes(&valid_bytes(DType::I64, index, s, per as usize), DType::I64, &[per]))
                .collect::<tensor_queue::Result<_>>()?;
            (0..n64).map(|k| storages[(k % 16) as usize].narrow(0, (k / 16) * 4, 4)).collect()
        }
        2 => {
            const DTYPES: [DType; 10] = [
                DType::Bool,
                DType::U8,
                DType::I8,
                DType::I16,
                DType::I32,
                DType::I64,
                DType::F16,
                DType::BF16,
                DType::F32,
                DType::F64,
            ];
            (0..n64)
                .map(|k| {
                    let dtype = DTYPES[(k % 10) as usize];
                    let elements = (k % 9 + 1) as usize;
                    Tensor::from_bytes(&valid_bytes(dtype, index, k, elements), dtype, &[elements as u64])
                })
                .collect()
        }
        3 => {
            let base = Tensor::from_bytes(&valid_bytes(DType::I16, index, 0, n * 2), DType::I16, &[n64 * 2])?;
            (0..n64)
                .map(|k| match k % 6 {
                    0 => Tensor::zeros(DType::F32, &[0]),
                    3 => base.narrow(0, k * 2, 0),
                    5 => Tensor::zeros(DType::U8, &[3, 0]),
                    _ => base.narrow(0, k * 2, 2),
                })
                .collect()
        }
        _ => {
            // A [n, 6] matrix of i32; each tensor a strided view of part of it.
            let base = Tensor::from_bytes(&valid_bytes(DType::I32, index, 0, n * 6), DType::I32, &[n64, 6])?;
            (0..n64)
                .map(|k| match k % 4 {
                    0 => base.narrow(0, k, 1)?.transpose(0, 1), // [6, 1], strides [1, 6]
                    1 => base.select(1, k % 6)?.narrow(0, k.saturating_sub(2), 3), // a column: stride 6
                    2 => base.narrow(0, k, 1)?.flip(&[1]),      // negative stride
                    _ => base.narrow(0, k, 1)?.narrow(1, 1, 3)?.expand(&[4, 3]), // stride 0
                })
                .collect()
        }
    }
}

/// Checks a received many-tensor message against `many_tensors(index, n)` made here; the first
/// difference, named, or `None`.
pub fn many_tensors_differ(index: u64, n: usize, got: &[Tensor]) -> Option<String> {
    let want = match many_tensors(index, n) {
        Ok(want) => want,
        Err(error) => return Some(format!("making the expected tensors: {error:?}")),
    };
    if got.len() != want.len() {
        return Some(format!("message {index}: {} tensors, expected {}", got.len(), want.len()));
    }
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        let (g, w) = match (Expected::of(g), Expected::of(w)) {
            (Ok(g), Ok(w)) => (g, w),
            (g, w) => return Some(format!("message {index} tensor {k}: reading it: {:?} / {:?}", g.err(), w.err())),
        };
        if g != w {
            return Some(format!("message {index} tensor {k} (layout {}): got {g:?}, expected {w:?}", index % LAYOUTS));
        }
    }
    None
}
