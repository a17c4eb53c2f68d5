//! The second process of the TCP channel tests (`tests/tests/tcp_host.rs`): `tcp-peer <role> [options]`.
//! The shared secret comes from `TQ_SECRET` (the tests set it, leave it out, or set a wrong one).
//!
//! Roles:
//! - `send --to EP --count N [--tag T] [--seed S] [--len L] [--pause-ms M] [--linger]`: connect to
//!   the receiver at `EP` (`tcp://host:port` or a Unix socket path) and send `N` [`Probe`]s, probe
//!   `i` with id `(T << 32) | i` and one `L`-byte tensor (default 4096) holding
//!   `pattern(L, S + i)`, its [`digest`] in `expected`; say `connected`, then `sent N`; with
//!   `--linger`, stay until stdin closes;
//! - `send-kinds --to EP`: send one [`Nested`] message ([`nested`]) and say `sent`;
//! - `recv --bind EP [--capacity C] [--count N] [--idle]`: bind a receiver, say `listening PORT`
//!   (`listening unix` for a path), and say `got ID ok|bad PATH PID` for each message (PID: the
//!   sender's, as it said); with `--count`, exit after `N` messages; with `--idle`, receive only
//!   when stdin says `read K`; exits when stdin closes.
//!
//! Any error: `error CLASS DEBUG` on stdout and exit status 1 (CLASS: `AuthFailed`,
//! `InvalidArgument`, `HandshakeTimeout`, or the `tensor_queue::Error` variant's name).

use std::collections::BTreeMap;
use std::io::BufRead as _;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use integration_tests::program::say;
use integration_tests::queue::Probe;
use integration_tests::{arg, number};
use kernels::reference;
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

/// A message with tensors at every depth: a struct, an option, a vector, a map, a tuple.
#[derive(Serialize, Deserialize)]
pub struct Nested {
    /// Plain data.
    pub title: String,
    /// A struct with tensors inside.
    pub header: Header,
    /// A vector of tensors of several dtypes and sizes.
    pub batch: Vec<Tensor>,
    /// One tensor per dtype (`DType::ALL`), named by its dtype's `Debug`.
    pub by_dtype: Vec<(String, Tensor)>,
    /// Strided and offset views, with what the sender saw of them.
    pub views: Vec<View>,
    /// Tensors in a map.
    pub map: BTreeMap<String, (u32, Tensor)>,
}

/// A struct inside the message.
#[derive(Serialize, Deserialize)]
pub struct Header {
    /// A number.
    pub step: u64,
    /// The `[6, 8]` f32 matrix `m[i][j] = (8 i + j) / 2`.
    pub weights: Tensor,
    /// A present optional tensor.
    pub mask: Option<Tensor>,
    /// An absent one.
    pub nothing: Option<Tensor>,
}

/// A view and what the sender saw of it.
#[derive(Serialize, Deserialize)]
pub struct View {
    /// How it was made.
    pub name: String,
    /// The view.
    pub tensor: Tensor,
    /// Its shape at the sender.
    pub shape: Vec<u64>,
    /// Its strides at the sender.
    pub strides: Vec<i64>,
}

/// The `[6, 8]` f32 matrix `m[i][j] = (8 i + j) / 2`.
pub fn matrix() -> Tensor {
    let data: Vec<f32> = (0..48).map(|n| n as f32 * 0.5).collect();
    Tensor::from_slice(&data, DType::F32, &[6, 8]).expect("a matrix")
}

/// Bytes `[6, 7]`: `b[i][j] = 7 i + j`.
pub fn bytes_matrix() -> Tensor {
    Tensor::from_slice(&(0..42u8).collect::<Vec<_>>(), DType::U8, &[6, 7]).expect("bytes")
}

/// `[3, 4, 5]` i32: `v[i][j][k] = 100 i + 10 j + k`.
pub fn cube() -> Tensor {
    let data: Vec<i32> =
        (0..3).flat_map(|i| (0..4).flat_map(move |j| (0..5).map(move |k| 100 * i + 10 * j + k))).collect();
    Tensor::from_slice(&data, DType::I32, &[3, 4, 5]).expect("a cube")
}

/// The bytes of the tensor of `dtype` in [`Nested::by_dtype`].
pub fn dtype_bytes(dtype: DType) -> Vec<u8> {
    let bytes = reference::pattern(dtype.size() * 30, 1000 + dtype as u64);
    // A Bool is 0 or 1.
    if dtype == DType::Bool { bytes.iter().map(|b| b & 1).collect() } else { bytes }
}

/// The bytes of tensor `i` of [`Nested::batch`].
pub fn batch_bytes(i: usize) -> Vec<u8> {
    reference::pattern(8 * (1 + i * 13 % 97), 5000 + i as u64)
}

/// How many tensors [`Nested::batch`] holds.
pub const BATCH: usize = 40;

/// The message `send-kinds` sends.
pub fn nested() -> Result<Nested> {
    let m = matrix();
    let b = bytes_matrix();
    let c = cube();
    let view = |name: &str, tensor: Tensor| View {
        name: name.to_string(),
        shape: tensor.shape().to_vec(),
        strides: tensor.strides().to_vec(),
        tensor,
    };
    let views = vec![
        view("transpose(0,1)", m.transpose(0, 1)?),
        view("narrow(1,2,3)", m.narrow(1, 2, 3)?),
        view("narrow(0,2,3)", m.narrow(0, 2, 3)?),
        view("narrow(1,1,4).transpose(0,1)", m.narrow(1, 1, 4)?.transpose(0, 1)?),
        view("bytes.narrow(1,3,3)", b.narrow(1, 3, 3)?),
        view("bytes.narrow(0,1,4).transpose(0,1)", b.narrow(0, 1, 4)?.transpose(0, 1)?),
        view("cube.transpose(0,2)", c.transpose(0, 2)?),
        view("cube.narrow(2,1,3).narrow(0,1,2)", c.narrow(2, 1, 3)?.narrow(0, 1, 2)?),
    ];
    let by_dtype = DType::ALL
        .iter()
        .map(|&dtype| {
            let bytes = dtype_bytes(dtype);
            let numel = (bytes.len() / dtype.size()) as u64;
            Ok((format!("{dtype:?}"), Tensor::from_bytes(&bytes, dtype, &[numel])?))
        })
        .collect::<Result<Vec<_>>>()?;
    let batch = (0..BATCH)
        .map(|i| {
            let bytes = batch_bytes(i);
            let len = bytes.len() as u64;
            Ok(Tensor::from_bytes(&bytes, DType::I64, &[len / 8])?)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut map = BTreeMap::new();
    map.insert("alpha".to_string(), (1, Tensor::from_slice(&[1.0f64, -2.5], DType::F64, &[2])?));
    map.insert("beta".to_string(), (2, Tensor::from_slice(&[7u8; 3], DType::U8, &[3])?));
    Ok(Nested {
        title: "nested over tcp".into(),
        header: Header {
            step: 42,
            weights: m.clone(),
            mask: Some(Tensor::from_slice(&[1u8, 0, 1, 1], DType::U8, &[2, 2])?),
            nothing: None,
        },
        batch,
        by_dtype,
        views,
        map,
    })
}

/// A fast position-sensitive digest of bytes (the per-byte reference checksum is slow in debug
/// builds for tens of MiB).
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let w = u64::from_le_bytes(word.try_into().unwrap_or_default());
        h = (h.rotate_left(7) ^ w).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    for &b in words.remainder() {
        h = (h.rotate_left(7) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    h
}

/// Probe `id` with one `len`-byte tensor holding `pattern(len, seed)`, its digest expected.
pub fn make_probe(id: u64, seed: u64, len: usize) -> Result<Probe> {
    let bytes = reference::pattern(len, seed);
    let expected = vec![digest(&bytes)];
    let tensor = Tensor::from_slice(&bytes, DType::U8, &[len as u64])?;
    Ok(Probe { id, tensors: vec![tensor], expected, note: format!("seed {seed}") })
}

/// Whether every tensor of `probe` reads as its expected digest.
pub fn probe_ok(probe: &Probe) -> bool {
    probe.tensors.len() == probe.expected.len()
        && probe.tensors.iter().zip(&probe.expected).all(|(t, &e)| t.to_bytes().is_ok_and(|b| digest(&b) == e))
}

/// The error's class, as the tests match it.
fn class(error: &Error) -> String {
    match error {
        Error::Core(ipc_core::Error::AuthFailed { .. }) => "AuthFailed".into(),
        Error::Core(ipc_core::Error::InvalidArgument(_)) => "InvalidArgument".into(),
        Error::Core(ipc_core::Error::HandshakeTimeout { .. }) => "HandshakeTimeout".into(),
        other => format!("{other:?}").split(['(', ' ', '{']).next().unwrap_or_default().to_string(),
    }
}

fn main() {
    match run() {
        Ok(()) => {}
        Err(error) => {
            let line = match error.downcast_ref::<Error>() {
                Some(e) => format!("error {} {e:?}", class(e)),
                None => format!("error Other {error:#}"),
            };
            say(&line);
            eprintln!("tcp-peer: {error:#}");
            std::process::exit(1);
        }
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().context("usage: tcp-peer <role> [options]")?.as_str();
    let flag = |name: &str| args.iter().any(|a| a == name);
    match role {
        "send" => {
            let to = arg(&args, "--to").context("--to <endpoint>")?;
            send(
                &to,
                number(&args, "--count", 1)?,
                number(&args, "--tag", 0)?,
                number(&args, "--seed", 1)?,
                number(&args, "--len", 4096)? as usize,
                number(&args, "--pause-ms", 0)?,
                flag("--linger"),
            )
        }
        "send-kinds" => {
            let to = arg(&args, "--to").context("--to <endpoint>")?;
            let sender = Sender::<Nested>::connect(to.as_str())?;
            say("connected");
            sender.send(&nested()?)?;
            say("sent");
            // Stay connected until the receiver has had time to read it.
            wait_for_stdin_eof();
            Ok(())
        }
        "recv" => {
            let bind = arg(&args, "--bind").context("--bind <endpoint>")?;
            let count = arg(&args, "--count").map(|c| c.parse::<u64>()).transpose()?;
            recv(&bind, number(&args, "--capacity", 16)? as u32, count, flag("--idle"))
        }
        other => bail!("unknown role {other}"),
    }
}

fn wait_for_stdin_eof() {
    let mut line = String::new();
    while std::io::stdin().lock().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
}

fn send(to: &str, count: u64, tag: u64, seed: u64, len: usize, pause_ms: u64, linger: bool) -> Result<()> {
    let sender = Sender::<Probe>::connect(to)?;
    say("connected");
    for i in 0..count {
        let mut probe = make_probe((tag << 32) | i, seed + i, len)?;
        probe.note = format!("tag {tag}");
        sender.send(&probe)?;
        if pause_ms > 0 {
            std::thread::sleep(Duration::from_millis(pause_ms));
        }
    }
    say(&format!("sent {count}"));
    if linger {
        wait_for_stdin_eof();
    }
    Ok(())
}

fn recv(bind: &str, capacity: u32, count: Option<u64>, idle: bool) -> Result<()> {
    let mut receiver = Receiver::<Probe>::builder().capacity(capacity).bind(bind)?;
    match receiver.local_addr() {
        Some(addr) => say(&format!("listening {}", addr.port())),
        None => say("listening unix"),
    }
    let mut got = 0u64;
    if idle {
        // Receive only when told: `read K`.
        for line in std::io::stdin().lock().lines() {
            let line = line?;
            let Some(k) = line.strip_prefix("read ") else { bail!("unknown command {line}") };
            let target = got + k.trim().parse::<u64>()?;
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while got < target && std::time::Instant::now() < deadline {
                got += u64::from(take(&mut receiver));
            }
            say(&format!("read-done {got}"));
        }
        return Ok(());
    }
    // Exit when stdin closes (the test is done or gone).
    std::thread::spawn(|| {
        wait_for_stdin_eof();
        std::process::exit(0);
    });
    loop {
        got += u64::from(take(&mut receiver));
        if count.is_some_and(|c| got >= c) {
            say(&format!("done {got}"));
            return Ok(());
        }
    }
}

/// Receives one message (within 200 ms) and says what it was; whether one came.
fn take(receiver: &mut Receiver<Probe>) -> bool {
    match receiver.recv_with_info(Some(Duration::from_millis(200))) {
        Ok((probe, info)) => {
            let ok = if probe_ok(&probe) { "ok" } else { "bad" };
            let path = probe.tensors.first().map_or("none".to_string(), |t| format!("{:?}", t.path()));
            say(&format!("got {} {ok} {path} {}", probe.id, info.sender_pid));
            true
        }
        // A bound receiver between senders, or before the first: nobody is there yet.
        Err(Error::Disconnected) => {
            std::thread::sleep(Duration::from_millis(5));
            false
        }
        Err(Error::Timeout) => false,
        Err(other) => {
            say(&format!("recv-error {} {other:?}", class(&other)));
            false
        }
    }
}
