//! tensor-queue channels over TCP (issue 13), host tensors only (no GPU needed), between real
//! processes on 127.0.0.1, as a user outside the workspace sees them: only the public API, the
//! second process always `tcp-peer` (`tests/src/bin/tcp-peer.rs`), started as its own program.
//! Hostile peers speak the documented wire format by hand (`tq-auth-v1`, u32-LE records of
//! `wire::Frame`s). Every wait has a deadline; children are killed when their test ends.

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use integration_tests::queue::{Probe, wait_for};
use integration_tests::talk::Talking;
use integration_tests::{bin_path, socket_path};
use ipc_core::tcp::{MAX_MESSAGE, TcpLink, TcpListener};
use kernels::reference;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tensor_queue::testing::wire::{
    Assembler, Descriptors, Fence, Frame, Hello, MAX_INLINE_BYTES, Source, StorageDesc, ToReceiver,
};
use tensor_queue::{Broadcast, DType, Endpoint, Error, Receiver, Secret, Sender, Tensor, TensorDevice, TransferPath};

/// The helper program, compiled in here too for its message types and checks.
#[allow(dead_code, missing_docs, unreachable_pub)]
#[path = "../src/bin/tcp-peer.rs"]
mod peer;

use peer::{BATCH, Nested, batch_bytes, digest, dtype_bytes, make_probe, probe_ok};

/// The shared secret of the honest peers.
const KEY: &str = "tcp-host-tests-shared-secret-0123456789";
/// Another secret, long enough to be accepted as one.
const WRONG: &str = "a-different-secret-of-plenty-bytes";
const SECRET_ENV: &str = "TQ_SECRET";
/// The length of a `tq-auth-v1` greeting: the tag, the role byte and a 32-byte nonce.
const GREETING: usize = 43;

fn secret_of(key: &str) -> Secret {
    Secret::from_bytes(key.as_bytes()).expect("a secret of enough bytes")
}

/// The secret for ipc-core's TCP link, which the tests below drive directly.
fn link_secret_of(key: &str) -> ipc_core::tcp::Secret {
    ipc_core::tcp::Secret::from_bytes(key.as_bytes()).expect("a secret of enough bytes")
}

/// Binds a TCP receiver on a port of the system's choice, with the honest secret; returns it and
/// its endpoint (`tcp://127.0.0.1:PORT`).
fn bind<T: DeserializeOwned>(capacity: u32) -> (Receiver<T>, String) {
    let receiver = Receiver::<T>::builder()
        .secret(secret_of(KEY))
        .capacity(capacity)
        .bind("tcp://127.0.0.1:0")
        .expect("binding a TCP receiver");
    let addr = receiver.local_addr().expect("a TCP receiver has an address");
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    (receiver, format!("tcp://{addr}"))
}

fn addr_of(endpoint: &str) -> SocketAddr {
    endpoint.strip_prefix("tcp://").expect("a tcp endpoint").parse().expect("an address")
}

fn connect<T: Serialize>(endpoint: &str, key: &str) -> tensor_queue::Result<Sender<T>> {
    Sender::<T>::builder().secret(secret_of(key)).timeout(Duration::from_secs(10)).connect(endpoint)
}

fn is_auth_failed(error: &Error) -> bool {
    matches!(error, Error::Core(ipc_core::Error::AuthFailed { .. }))
}

fn is_handshake_timeout(error: &Error) -> bool {
    matches!(error, Error::Core(ipc_core::Error::HandshakeTimeout { .. }))
}

/// The `Error` variant's name.
fn variant(error: &Error) -> String {
    format!("{error:?}").split(['(', ' ', '{']).next().unwrap_or_default().to_string()
}

/// Runs `work` on a thread and gives its result within `timeout`, or `None` (the thread is left
/// behind; the test's children are killed when it ends, which frees whatever it waits for).
fn within<R: Send + 'static>(timeout: Duration, work: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(work());
    });
    rx.recv_timeout(timeout).ok()
}

/// Bytes nobody could predict twice.
fn random_bytes(len: usize) -> Vec<u8> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = tensor_queue::monotonic_ns() ^ (COUNTER.fetch_add(1, Ordering::Relaxed) << 48);
    reference::pattern(len, reference::splitmix64(seed))
}

integration_tests::talking!(
    /// A running `tcp-peer` or `tq-hostile` (its lines, its stdin, and a kill when it goes out of
    /// scope).
    Peer
);

impl Peer {
    /// Starts `tcp-peer <args>` with `TQ_SECRET` set to `secret`, or unset.
    fn start(args: &[&str], secret: Option<&str>) -> Peer {
        Peer::program("tcp-peer", args, secret)
    }

    /// Starts `<program> <args>` (a helper of this crate) with `TQ_SECRET` set to `secret`, or
    /// unset.
    fn program(program: &str, args: &[&str], secret: Option<&str>) -> Peer {
        Peer::program_env(program, args, secret, &[])
    }

    /// As [`Peer::program`], with `env` set too.
    fn program_env(program: &str, args: &[&str], secret: Option<&str>, env: &[(&str, &str)]) -> Peer {
        let mut command = Command::new(bin_path(program).expect("the helper is built"));
        command.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        command.envs(env.iter().copied());
        match secret {
            Some(secret) => command.env(SECRET_ENV, secret),
            None => command.env_remove(SECRET_ENV),
        };
        let child = command.spawn().unwrap_or_else(|e| panic!("starting {program}: {e}"));
        let tag = format!("{program} {} {}", args.first().unwrap_or(&""), child.id());
        Peer(Talking::adopt(program, child, tag))
    }

    /// `tcp-peer recv --bind tcp://127.0.0.1:0 <extra>` with the honest secret, and its endpoint
    /// once it listens.
    fn receiver(extra: &[&str]) -> (Peer, String) {
        let mut args = vec!["recv", "--bind", "tcp://127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut peer = Peer::start(&args, Some(KEY));
        let line = peer.expect("listening", Duration::from_secs(20));
        let port: u16 = line.trim_start_matches("listening ").parse().expect("a port");
        (peer, format!("tcp://127.0.0.1:{port}"))
    }

    /// The next `count` lines starting with `got`.
    fn got(&mut self, count: usize, timeout: Duration) -> Vec<String> {
        (0..count).map(|_| self.expect("got ", timeout)).collect()
    }
}

/// What a `got` line says: id, intact, path, sender pid.
fn parse_got(line: &str) -> (u64, bool, String, u32) {
    let fields: Vec<&str> = line.split(' ').collect();
    assert!(fields.len() == 5 && fields[0] == "got", "{line}");
    (fields[1].parse().unwrap(), fields[2] == "ok", fields[3].to_string(), fields[4].parse().unwrap())
}

/// Receives `count` messages, for at most `timeout`: a bound receiver says `Disconnected` while
/// nobody is connected, which is waited out here; other errors are collected and returned.
fn receive_n<T: DeserializeOwned>(
    receiver: &mut Receiver<T>,
    count: usize,
    timeout: Duration,
    mut take: impl FnMut(T, tensor_queue::MessageInfo),
) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    let mut errors = Vec::new();
    let mut received = 0;
    while received < count {
        if Instant::now() > deadline {
            panic!(
                "{received} of {count} messages after {timeout:?}; recv errors {errors:?}; receiver errors {:?}",
                receiver.take_errors()
            );
        }
        match receiver.recv_with_info(Some(Duration::from_millis(200))) {
            Ok((message, info)) => {
                received += 1;
                take(message, info);
            }
            Err(Error::Disconnected) => std::thread::sleep(Duration::from_millis(2)),
            Err(Error::Timeout) => {}
            Err(other) => errors.push(format!("{other:?}")),
        }
    }
    errors
}

// ---------------------------------------------------------------------------------------------
// Endpoints

#[test]
fn endpoints_parse_as_documented() {
    assert!(matches!(Endpoint::from("tcp://127.0.0.1:7000"), Endpoint::Tcp(ref a) if a == "127.0.0.1:7000"));
    assert!(matches!(Endpoint::from("tcp://[::1]:7000".to_string()), Endpoint::Tcp(ref a) if a == "[::1]:7000"));
    let path = socket_path("tcp-endpoint");
    assert!(matches!(Endpoint::from(path.to_str().unwrap()), Endpoint::Unix(ref p) if *p == path));
    assert!(matches!(Endpoint::from(&path), Endpoint::Unix(ref p) if *p == path));
    assert!(matches!(Endpoint::from(path.as_path()), Endpoint::Unix(ref p) if *p == path));
    let unix = Receiver::<u64>::bind(&path).unwrap();
    assert!(unix.local_addr().is_none(), "a Unix receiver has no TCP address");
}

// ---------------------------------------------------------------------------------------------
// 1. Every dtype, views, nested messages

/// `m[i][j]` of [`peer::matrix`].
fn m(i: u64, j: u64) -> f32 {
    (8 * i + j) as f32 * 0.5
}

fn f32s(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

fn i32s(values: impl IntoIterator<Item = i32>) -> Vec<u8> {
    values.into_iter().flat_map(i32::to_le_bytes).collect()
}

/// `v[i][j][k]` of [`peer::cube`].
fn c(i: u64, j: u64, k: u64) -> i32 {
    (100 * i + 10 * j + k) as i32
}

/// Each view `send-kinds` sends: its shape and row-major bytes, worked out by hand.
fn expected_views() -> BTreeMap<&'static str, (Vec<u64>, Vec<u8>)> {
    let b = |i: u64, j: u64| (7 * i + j) as u8;
    BTreeMap::from([
        ("transpose(0,1)", (vec![8, 6], f32s((0..8).flat_map(|j| (0..6).map(move |i| m(i, j)))))),
        ("narrow(1,2,3)", (vec![6, 3], f32s((0..6).flat_map(|i| (2..5).map(move |j| m(i, j)))))),
        ("narrow(0,2,3)", (vec![3, 8], f32s((2..5).flat_map(|i| (0..8).map(move |j| m(i, j)))))),
        ("narrow(1,1,4).transpose(0,1)", (vec![4, 6], f32s((1..5).flat_map(|j| (0..6).map(move |i| m(i, j)))))),
        ("bytes.narrow(1,3,3)", (vec![6, 3], (0..6).flat_map(|i| (3..6).map(move |j| b(i, j))).collect())),
        (
            "bytes.narrow(0,1,4).transpose(0,1)",
            (vec![7, 4], (0..7).flat_map(|j| (1..5).map(move |i| b(i, j))).collect()),
        ),
        (
            "cube.transpose(0,2)",
            (vec![5, 4, 3], i32s((0..5).flat_map(|k| (0..4).flat_map(move |j| (0..3).map(move |i| c(i, j, k)))))),
        ),
        (
            "cube.narrow(2,1,3).narrow(0,1,2)",
            (vec![2, 4, 3], i32s((1..3).flat_map(|i| (0..4).flat_map(move |j| (1..4).map(move |k| c(i, j, k)))))),
        ),
    ])
}

/// Where `tensor` differs from a host tensor that came over TCP with these bytes and shape.
fn check_tensor(what: &str, tensor: &Tensor, dtype: DType, shape: &[u64], bytes: &[u8], failures: &mut Vec<String>) {
    if tensor.path() != TransferPath::Tcp {
        failures.push(format!("{what}: path {:?}, not Tcp", tensor.path()));
    }
    if !matches!(tensor.device(), TensorDevice::Host) {
        failures.push(format!("{what}: device {:?}, not the host", tensor.device()));
    }
    if tensor.dtype() != dtype {
        failures.push(format!("{what}: dtype {:?}, not {dtype:?}", tensor.dtype()));
    }
    if tensor.shape() != shape {
        failures.push(format!("{what}: shape {:?}, not {shape:?}", tensor.shape()));
    }
    match tensor.to_bytes() {
        Ok(read) if read == bytes => {}
        Ok(read) => failures.push(format!("{what}: other bytes ({} read, {} expected)", read.len(), bytes.len())),
        Err(error) => failures.push(format!("{what}: unreadable: {error:?}")),
    }
}

#[test]
fn every_dtype_views_and_nested_tensors_cross_tcp_intact() {
    let (mut receiver, endpoint) = bind::<Nested>(4);
    let mut sender = Peer::start(&["send-kinds", "--to", &endpoint], Some(KEY));
    let (message, info) = receiver.recv_with_info(Some(Duration::from_secs(30))).expect("the nested message");
    assert_eq!(info.sender_pid, sender.id(), "MessageInfo::sender_pid is the sender's");
    sender.expect("sent", Duration::from_secs(10));
    let mut failures = Vec::new();
    assert_eq!(message.title, "nested over tcp");
    assert_eq!(message.header.step, 42);
    check_tensor(
        "header.weights",
        &message.header.weights,
        DType::F32,
        &[6, 8],
        &f32s((0..6).flat_map(|i| (0..8).map(move |j| m(i, j)))),
        &mut failures,
    );
    match &message.header.mask {
        Some(mask) => check_tensor("header.mask", mask, DType::U8, &[2, 2], &[1, 0, 1, 1], &mut failures),
        None => failures.push("header.mask: lost".into()),
    }
    assert!(message.header.nothing.is_none());
    assert_eq!(message.batch.len(), BATCH);
    for (i, tensor) in message.batch.iter().enumerate() {
        let bytes = batch_bytes(i);
        check_tensor(&format!("batch[{i}]"), tensor, DType::I64, &[bytes.len() as u64 / 8], &bytes, &mut failures);
    }
    let names: Vec<&str> = message.by_dtype.iter().map(|(n, _)| n.as_str()).collect();
    let all: Vec<String> = DType::ALL.iter().map(|d| format!("{d:?}")).collect();
    assert_eq!(names, all, "one tensor per dtype");
    for ((name, tensor), &dtype) in message.by_dtype.iter().zip(DType::ALL.iter()) {
        let bytes = dtype_bytes(dtype);
        let numel = (bytes.len() / dtype.size()) as u64;
        check_tensor(&format!("dtype {name}"), tensor, dtype, &[numel], &bytes, &mut failures);
    }
    let expected = expected_views();
    let sent: Vec<&str> = message.views.iter().map(|v| v.name.as_str()).collect();
    let mut sorted = sent.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, expected.keys().copied().collect::<Vec<_>>(), "the views sent");
    for view in &message.views {
        let (shape, bytes) = &expected[view.name.as_str()];
        let dtype = if view.name.starts_with("bytes") {
            DType::U8
        } else if view.name.starts_with("cube") {
            DType::I32
        } else {
            DType::F32
        };
        check_tensor(&format!("view {}", view.name), &view.tensor, dtype, shape, bytes, &mut failures);
        if view.tensor.shape() != view.shape.as_slice() || view.tensor.strides() != view.strides.as_slice() {
            failures.push(format!(
                "view {}: shape/strides {:?}/{:?} at the receiver, {:?}/{:?} at the sender",
                view.name,
                view.tensor.shape(),
                view.tensor.strides(),
                view.shape,
                view.strides
            ));
        }
    }
    let transposed = &message.views.iter().find(|v| v.name == "transpose(0,1)").unwrap().tensor;
    assert!(!transposed.is_contiguous(), "a transposed view stays a view");
    let (one, alpha) = &message.map["alpha"];
    assert_eq!(*one, 1);
    check_tensor("map.alpha", alpha, DType::F64, &[2], &f64_bytes(&[1.0, -2.5]), &mut failures);
    let (two, beta) = &message.map["beta"];
    assert_eq!(*two, 2);
    check_tensor("map.beta", beta, DType::U8, &[3], &[7, 7, 7], &mut failures);
    assert!(failures.is_empty(), "{failures:#?}");
    sender.close_stdin();
    assert!(sender.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

fn f64_bytes(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

// ---------------------------------------------------------------------------------------------
// 2. Many senders

#[test]
fn four_sender_processes_and_three_threads_feed_one_tcp_receiver() {
    const COUNT: u64 = 50;
    let (mut receiver, endpoint) = bind::<Probe>(16);
    let mut processes: Vec<Peer> = (1..=4u64)
        .map(|tag| {
            let (tag, seed) = (tag.to_string(), (tag * 1000).to_string());
            let args = ["send", "--to", &endpoint, "--count", "50", "--tag", &tag, "--seed", &seed, "--len", "1500"];
            Peer::start(&args, Some(KEY))
        })
        .collect();
    let (done_tx, done) = mpsc::channel();
    for tag in 11..=13u64 {
        let (endpoint, done_tx) = (endpoint.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let result = (|| -> tensor_queue::Result<()> {
                let sender = connect::<Probe>(&endpoint, KEY)?;
                for i in 0..COUNT {
                    let mut probe = make_probe((tag << 32) | i, tag * 1000 + i, 100 + (i as usize * 97) % 3000)
                        .map_err(|e| Error::Invalid(e.to_string()))?;
                    probe.note = format!("tag {tag}");
                    sender.send(&probe)?;
                }
                Ok(())
            })();
            let _ = done_tx.send((tag, result.map_err(|e| format!("{e:?}"))));
        });
    }
    let pids: BTreeMap<u64, u32> = processes.iter().zip(1..).map(|(p, tag)| (tag, p.id())).collect();
    let mut seen: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut failures = Vec::new();
    let errors = receive_n(&mut receiver, 7 * COUNT as usize, Duration::from_secs(45), |probe: Probe, info| {
        let (tag, index) = (probe.id >> 32, probe.id & 0xffff_ffff);
        if !probe_ok(&probe) {
            failures.push(format!("tag {tag} message {index}: other bytes"));
        }
        if probe.tensors[0].path() != TransferPath::Tcp {
            failures.push(format!("tag {tag} message {index}: path {:?}", probe.tensors[0].path()));
        }
        let pid = pids.get(&tag).copied().unwrap_or(std::process::id());
        if info.sender_pid != pid {
            failures.push(format!("tag {tag}: sender_pid {} but the sender is {pid}", info.sender_pid));
        }
        // One clock for every process of the machine: a message's stages are in order.
        let stages = [info.sent_ns, info.encoded_ns, info.arrived_ns, info.imported_ns, info.taken_ns, info.decoded_ns];
        if !stages.is_sorted() {
            failures.push(format!("tag {tag} message {index}: stages out of order {stages:?}"));
        }
        seen.entry(tag).or_default().push(index);
    });
    for _ in 0..3 {
        let (tag, result) = done.recv_timeout(Duration::from_secs(30)).expect("a sending thread is stuck");
        assert!(result.is_ok(), "thread {tag}: {result:?}");
    }
    for process in &mut processes {
        process.expect("sent 50", Duration::from_secs(10));
        assert!(process.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
    }
    assert!(errors.is_empty(), "recv errors: {errors:?}");
    assert!(failures.is_empty(), "{failures:#?}");
    let tags: Vec<u64> = seen.keys().copied().collect();
    assert_eq!(tags, [1, 2, 3, 4, 11, 12, 13]);
    for (tag, indices) in &seen {
        assert_eq!(*indices, (0..COUNT).collect::<Vec<_>>(), "tag {tag}: each once, in order");
    }
    // Nothing more (no duplicate arrives late), and with every sender gone: Disconnected.
    let end = receiver.recv_timeout(Duration::from_secs(10));
    assert!(matches!(end, Err(Error::Disconnected)), "after every sender left: {:?}", end.map(|p| p.id));
}

// ---------------------------------------------------------------------------------------------
// 3. Authentication

#[test]
fn a_wrong_secret_is_refused_and_honest_senders_are_served() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let wrong = connect::<Probe>(&endpoint, WRONG);
    assert!(matches!(&wrong, Err(e) if is_auth_failed(e)), "a wrong secret: {:?}", wrong.err());
    let mut impostor = Peer::start(&["send", "--to", &endpoint, "--count", "1", "--tag", "9"], Some(WRONG));
    let line = impostor.expect("error", Duration::from_secs(20));
    assert!(line.starts_with("error AuthFailed"), "{line}");
    assert!(impostor.exit_within(Duration::from_secs(10)).is_some_and(|s| !s.success()));

    let mut honest = Peer::start(&["send", "--to", &endpoint, "--count", "5", "--tag", "1"], Some(KEY));
    let mut ids = Vec::new();
    let errors = receive_n(&mut receiver, 5, Duration::from_secs(30), |probe: Probe, _| {
        assert!(probe_ok(&probe), "message {:x}: other bytes", probe.id);
        ids.push(probe.id);
    });
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(ids, (0..5).map(|i| (1 << 32) | i).collect::<Vec<_>>(), "the impostor sent nothing");
    assert!(honest.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));

    // Both refusals are reported, each once.
    let mut reported = Vec::new();
    wait_for(Duration::from_secs(10), || {
        reported.extend(receiver.take_errors());
        reported.iter().filter(|e| is_auth_failed(e)).count() >= 2
    });
    std::thread::sleep(Duration::from_millis(300));
    reported.extend(receiver.take_errors());
    let refusals = reported.iter().filter(|e| is_auth_failed(e)).count();
    assert_eq!(refusals, 2, "two connections with a wrong secret, each reported once: {reported:?}");
}

#[test]
fn no_secret_or_a_short_one_is_an_error_at_bind_and_connect() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    for secret in [None, Some("short")] {
        let mut binder = Peer::start(&["recv", "--bind", "tcp://127.0.0.1:0"], secret);
        let line = binder.expect("error", Duration::from_secs(20));
        let class = if secret.is_some() { "error SecretTooShort" } else { "error SecretNotSet" };
        assert!(line.starts_with(class), "bind with secret {secret:?}: {line}");
        assert!(line.contains(SECRET_ENV), "the error names the variable to set: {line}");
        assert!(binder.exit_within(Duration::from_secs(10)).is_some_and(|s| !s.success()));
        let mut connector = Peer::start(&["send", "--to", &endpoint, "--count", "1"], secret);
        let line = connector.expect("error", Duration::from_secs(20));
        assert!(line.starts_with(class), "connect with secret {secret:?}: {line}");
        assert!(connector.exit_within(Duration::from_secs(10)).is_some_and(|s| !s.success()));
    }
    // A short secret given in code: refused when made, with this crate's error.
    match Secret::from_bytes(b"short") {
        Err(Error::SecretTooShort { origin: "the secret given", len: 5, min: tensor_queue::MIN_SECRET_LEN }) => {}
        other => panic!("expected SecretTooShort, got {other:?}"),
    }
    // In this process, where the environment has no secret (the usual case for `cargo test`).
    if std::env::var_os(SECRET_ENV).is_none() {
        let bound = Receiver::<u64>::bind("tcp://127.0.0.1:0");
        assert!(matches!(bound, Err(Error::SecretNotSet { variable: SECRET_ENV })), "{:?}", bound.err());
        let connected = Sender::<Probe>::connect(endpoint.as_str());
        assert!(matches!(connected, Err(Error::SecretNotSet { variable: SECRET_ENV })), "{:?}", connected.err());
        let connected = Sender::<Probe>::builder().connect(endpoint.as_str());
        assert!(matches!(connected, Err(Error::SecretNotSet { variable: SECRET_ENV })), "{:?}", connected.err());
    }
    // The receiver never saw any of them and still serves.
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    sender.send(&make_probe(1, 1, 100).unwrap()).unwrap();
    let probe = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(probe.id == 1 && probe_ok(&probe));
}

#[test]
fn a_silent_connector_does_not_delay_an_honest_sender() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let addr = addr_of(&endpoint);
    let opened = Instant::now();
    // One says nothing at all; one stops halfway through its greeting.
    let silent = TcpStream::connect(addr).unwrap();
    let mut halfway = TcpStream::connect(addr).unwrap();
    halfway.write_all(b"tq-auth-v1C0123456789").unwrap();
    std::thread::sleep(Duration::from_millis(300));

    let start = Instant::now();
    let mut honest = Peer::start(&["send", "--to", &endpoint, "--count", "3", "--tag", "1"], Some(KEY));
    let mut ids = Vec::new();
    receive_n(&mut receiver, 3, Duration::from_secs(30), |p: Probe, _| ids.push(p.id));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "the honest sender waited {took:?} behind the silent ones (10 s?)");
    assert_eq!(ids, [1 << 32, (1 << 32) | 1, (1 << 32) | 2]);
    honest.expect("sent 3", Duration::from_secs(10));
    let start = Instant::now();
    let sender = connect::<Probe>(&endpoint, KEY).expect("an in-process sender connects too");
    sender.send(&make_probe(5, 5, 10).unwrap()).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().id, 5);
    assert!(start.elapsed() < Duration::from_secs(5), "connect waited {:?}", start.elapsed());

    // Both are dropped after about 10 s, having been told nothing computed from the secret.
    for (name, mut stream) in [("silent", silent), ("halfway", halfway)] {
        stream.set_read_timeout(Some(Duration::from_secs(25))).unwrap();
        let mut told = Vec::new();
        let closed = stream.read_to_end(&mut told);
        assert!(
            closed.is_ok() || closed.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "{name}: not dropped {:?} after connecting: {closed:?}",
            opened.elapsed()
        );
        assert!(told.len() <= GREETING, "{name}: told {} bytes", told.len());
        if !told.is_empty() {
            assert!(told.starts_with(b"tq-auth-v1S"), "{name}: {told:?}");
        }
    }
    let mut reported = Vec::new();
    wait_for(Duration::from_secs(5), || {
        reported.extend(receiver.take_errors());
        reported.iter().filter(|e| is_handshake_timeout(e)).count() >= 2
    });
    assert_eq!(reported.iter().filter(|e| is_handshake_timeout(e)).count(), 2, "{reported:?}");
}

/// `connect` to a port nobody listens on fails, and to a listener that never speaks gives up after
/// `SenderBuilder::timeout`: an error, never a hang.
#[test]
fn connect_to_nobody_or_to_a_mute_listener_fails_within_its_timeout() {
    // A port that was just free.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let start = Instant::now();
    let nobody = connect::<Probe>(&format!("tcp://127.0.0.1:{port}"), KEY);
    assert!(nobody.is_err(), "connected to nobody");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?} to find nobody listening", start.elapsed());
    // A listener that accepts and says nothing.
    let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", mute.local_addr().unwrap());
    let holder = std::thread::spawn(move || {
        let held = mute.accept();
        std::thread::sleep(Duration::from_secs(4));
        drop(held);
    });
    let outcome = within(Duration::from_secs(8), move || {
        let start = Instant::now();
        let builder = Sender::<Probe>::builder().secret(secret_of(KEY)).timeout(Duration::from_secs(1));
        let result = builder.connect(endpoint.as_str()).map(|_| ());
        (result.map_err(|e| format!("{e:?}")), start.elapsed())
    });
    let (result, took) = outcome.expect("connect to a mute listener hung past 8 s with a 1 s timeout");
    assert!(result.is_err(), "connected to a listener that never authenticated");
    assert!(took < Duration::from_secs(5), "gave up after {took:?} with a 1 s timeout: {result:?}");
    eprintln!("mute listener: {result:?} after {took:?}");
    holder.join().unwrap();
}

#[test]
fn garbage_before_the_handshake_is_refused_and_the_receiver_goes_on() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let addr = addr_of(&endpoint);
    let http = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8.0\r\nAccept: */*\r\n\r\n".to_vec();
    let mut reflected = b"tq-auth-v1S".to_vec();
    reflected.extend_from_slice(&random_bytes(32 + 32));
    let attacks: Vec<(&str, Vec<u8>)> =
        vec![("http", http), ("random", random_bytes(4096)), ("server role", reflected)];
    let mut streams = Vec::new();
    for (name, bytes) in attacks {
        let mut stream = TcpStream::connect(addr).unwrap();
        // The listener may close before taking everything: a failed write is fine.
        let _ = stream.write_all(&bytes);
        streams.push((name, stream, 0));
    }
    // A client greeting, then a wrong answer to the listener's challenge.
    let mut bad_mac = TcpStream::connect(addr).unwrap();
    bad_mac.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = b"tq-auth-v1C".to_vec();
    greeting.extend_from_slice(&random_bytes(32));
    bad_mac.write_all(&greeting).unwrap();
    let mut theirs = [0u8; GREETING];
    bad_mac.read_exact(&mut theirs).expect("the listener's greeting");
    assert_eq!(&theirs[..11], b"tq-auth-v1S");
    bad_mac.write_all(&[0u8; 32]).unwrap();
    streams.push(("wrong answer", bad_mac, GREETING));

    for (name, stream, already) in &mut streams {
        stream.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let mut told = Vec::new();
        let closed = stream.read_to_end(&mut told);
        assert!(
            closed.is_ok() || closed.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "{name}: not closed: {closed:?}"
        );
        assert!(*already + told.len() <= GREETING, "{name}: told {} bytes beyond the greeting", told.len());
    }
    let mut honest = Peer::start(&["send", "--to", &endpoint, "--count", "5", "--tag", "2"], Some(KEY));
    let mut ids = Vec::new();
    let errors = receive_n(&mut receiver, 5, Duration::from_secs(30), |p: Probe, _| {
        assert!(probe_ok(&p));
        ids.push(p.id & 0xffff_ffff);
    });
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(ids, [0, 1, 2, 3, 4]);
    assert!(honest.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
    let mut reported = Vec::new();
    let refused =
        |reported: &Vec<Error>| reported.iter().filter(|e| is_auth_failed(e) || is_handshake_timeout(e)).count();
    wait_for(Duration::from_secs(5), || {
        reported.extend(receiver.take_errors());
        refused(&reported) >= 4
    });
    std::thread::sleep(Duration::from_millis(300));
    reported.extend(receiver.take_errors());
    assert_eq!(refused(&reported), 4, "four refused connections, each reported once: {reported:?}");
}

/// This process's threads named `name` now (other tests of this binary run beside).
fn threads_named(name: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// A receiver that does not read yet (a server still setting up) under a storm of refused
/// connectors keeps accepting, and keeps no thread per connector: the accept thread rang its
/// doorbell for `recv` with a wait for room, so once a few hundred refusals were unread every
/// handshake thread stayed blocked, and then the accept thread too (outside tester, Python
/// round: 1,000 garbage connections left 722 threads behind; 1,400 stopped the listener). Only
/// then does the receiver read: the honest sender's message, and the refusals, the last 1,024.
#[test]
fn refused_connectors_cost_no_thread_and_keep_no_one_out_while_the_receiver_is_not_reading() {
    const STORM: usize = 2000;
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let addr = addr_of(&endpoint);
    let storm: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..STORM / 4 {
                    let mut stream = TcpStream::connect(addr).expect("the listener accepts");
                    let _ = stream.write_all(b"hello garbage\n");
                }
            })
        })
        .collect();
    for thread in storm {
        thread.join().unwrap();
    }
    let handshakes = || threads_named("tq-handshake");
    let settled = wait_for(Duration::from_secs(20), || handshakes() < 32);
    assert!(settled.is_some(), "{} handshake threads after {STORM} refused connectors", handshakes());
    let honest = endpoint.clone();
    let sent = within(Duration::from_secs(30), move || {
        let sender = connect::<Probe>(&honest, KEY)?;
        sender.send(&raw_probe(7, "after the storm"))
    });
    assert!(matches!(sent, Some(Ok(()))), "an honest sender after the storm: {sent:?}");
    let got = receiver.recv_timeout(Duration::from_secs(30)).expect("the honest message");
    assert_eq!(got.id, 7);
    let errors = receiver.take_errors();
    assert_eq!(errors.len(), 1024, "the last 1,024 refusals are kept");
    let shed = |e: &Error| matches!(e, Error::Core(ipc_core::Error::HandshakeShed { .. }));
    let other: Vec<_> = errors.iter().filter(|e| !is_auth_failed(e) && !shed(e)).collect();
    assert!(other.is_empty(), "refusals of garbage only: {other:?}");
}

/// A sender process that exits with a large message unread by a live receiver waits at most
/// `SENDER_DROP_TIMEOUT` in all (shortened here to 2 s by the tests' switch), then gives up the
/// rest, which the receiver reports. Over TCP the drop waited twice that: once for the message
/// to leave (its lease) and once more for the link's bytes (outside tester, Python round:
/// 121 s where 60 are documented).
#[test]
fn a_sender_exiting_with_a_message_unread_waits_one_drop_timeout_in_all() {
    const BOUND: Duration = Duration::from_secs(2);
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let bound_ms = BOUND.as_millis().to_string();
    let mut sender = Peer::program_env(
        "tcp-peer",
        &["send", "--to", &endpoint, "--count", "1", "--len", &(256u64 << 20).to_string()],
        Some(KEY),
        &[("TENSOR_QUEUE_TEST_DROP_TIMEOUT_MS", &bound_ms)],
    );
    sender.expect("sent 1", Duration::from_secs(60));
    let sent = Instant::now();
    let status = sender.exit_within(Duration::from_secs(30)).expect("the sender exits");
    let waited = sent.elapsed();
    assert!(status.success(), "{status:?}");
    // Twice the bound was the bug; the margin is for a loaded machine's exit.
    assert!(waited < BOUND + BOUND * 3 / 4, "the sender's exit took {waited:?} after its send (bound {BOUND:?})");
    let errors = errors_until(&mut receiver, |errors| !errors.is_empty());
    assert!(
        errors.iter().any(|e| matches!(e, Error::ConnectionClosed { .. })),
        "the unfinished message is reported: {errors:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Malformed frames after a correct handshake

/// A `Hello` as a sender says it.
fn hello(capacity: u32) -> Vec<u8> {
    integration_tests::raw::hello(capacity, 0x7e57).encode()
}

/// A descriptor table of one 64-byte storage record at `source`, viewed whole as `u8`.
fn one_view(source: Source) -> Descriptors {
    let mut tensors = Descriptors::default();
    let storage = tensors.push_storage(StorageDesc { source, len: 64, fence: Fence::None });
    tensors.push_tensor(storage, 0, DType::U8, &[64], &[1]);
    tensors
}

fn message(seq: u64, tensors: Descriptors, payload: &[u8]) -> Vec<u8> {
    let now = tensor_queue::monotonic_ns();
    ToReceiver::Message { seq, sent_ns: now, encoded_ns: now, tensors, payload: payload.to_vec() }.encode()
}

/// The serde payload a real `Sender` writes for `probe` over TCP, taken from it by a raw
/// listener that plays the receiver: raw frames can then carry a message the receiver decodes.
fn payload_of(probe: Probe) -> Vec<u8> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let sending = std::thread::spawn(move || {
        let sender = connect::<Probe>(&endpoint, KEY).unwrap();
        sender.send(&probe).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let link = listener.accept(Some(Duration::from_secs(10)), &link_secret_of(KEY)).unwrap();
    let mut buf = Vec::new();
    link.recv(&mut buf, Some(Duration::from_secs(10))).unwrap();
    let first = Hello::decode(&buf);
    assert!(first.is_ok(), "a TCP sender begins with Hello: {first:?}");
    link.send(&hello(4)).unwrap();
    for _ in 0..100 {
        let Incoming::Record = next_incoming(&link, &mut buf, Duration::ZERO).unwrap() else { continue };
        if let Ok(ToReceiver::Message { payload, .. }) = ToReceiver::decode(&buf) {
            sending.join().unwrap();
            return payload;
        }
    }
    panic!("no Message among the first 100 records");
}

/// What [`next_incoming`] read.
enum Incoming {
    /// A record (a frame or a part of one), in the buffer.
    Record,
    /// A bulk run of host bytes (a message's host tensors), in the buffer.
    Run,
}

/// The next record from a raw link into `buf`, or the whole bulk run of host bytes next in the
/// stream (read in pieces of at most 64 KiB, each after `pause`: a slow reader); 10 s at most
/// for each piece.
fn next_incoming(link: &TcpLink, buf: &mut Vec<u8>, pause: Duration) -> Result<Incoming, ipc_core::Error> {
    let left = match link.recv(buf, Some(Duration::from_secs(10))) {
        Ok(()) => return Ok(Incoming::Record),
        Err(ipc_core::Error::BulkAhead { left }) => left as usize,
        Err(error) => return Err(error),
    };
    buf.clear();
    buf.resize(left, 0);
    let mut got = 0;
    let mut waited_since = Instant::now();
    while got < left {
        std::thread::sleep(pause);
        let n = link.try_recv_bulk(&mut buf[got..(got + (64 << 10)).min(left)])?;
        got += n;
        if n > 0 {
            waited_since = Instant::now();
        } else if waited_since.elapsed() > Duration::from_secs(10) {
            return Err(ipc_core::Error::PeerGone);
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(Incoming::Run)
}

/// An authenticated raw link; with `hello`, it has also said Hello and had the receiver's, whose
/// capacity it returns.
fn raw_link(addr: SocketAddr, say_hello: bool) -> (TcpLink, u32) {
    let link = TcpLink::connect(addr, &link_secret_of(KEY), Duration::from_secs(10)).expect("the right secret");
    if !say_hello {
        return (link, 0);
    }
    link.send(&hello(0)).unwrap();
    let mut buf = Vec::new();
    for _ in 0..10 {
        link.recv(&mut buf, Some(Duration::from_secs(10))).expect("the receiver's answer");
        if let Ok(Hello { capacity, .. }) = Hello::decode(&buf) {
            return (link, capacity);
        }
    }
    panic!("the receiver never said Hello");
}

/// Whether the receiver closes `link` within `timeout` (what it says before is read and dropped).
fn closed_within(link: &TcpLink, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut buf = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("still open after {timeout:?}"));
        }
        match link.recv(&mut buf, Some(left)) {
            Ok(_) => {}
            Err(ipc_core::Error::Os { source, .. }) if source.kind() == std::io::ErrorKind::TimedOut => {}
            Err(ipc_core::Error::Os { source, .. }) if source.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return Ok(()),
        }
    }
}

/// One record read from a raw stream (10 s at most).
fn read_record(stream: &mut TcpStream) -> Vec<u8> {
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).expect("a record's length");
    let mut bytes = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut bytes).expect("a record");
    bytes
}

fn record(bytes: &[u8]) -> Vec<u8> {
    let mut out = (bytes.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(bytes);
    out
}

/// A probe without tensors whose note marks it as raw.
fn raw_probe(id: u64, note: &str) -> Probe {
    Probe { id, tensors: Vec::new(), expected: Vec::new(), note: note.into() }
}

/// Two honest sender processes send 10 messages each (20 ms apart) to `receiver`, while
/// `raw_controls` raw messages noted `raw-control` are due too: checks that all of them arrive
/// intact and in order, and returns the notes of every raw message delivered and the reasons of
/// the refusals `recv` returned.
fn serve_honest_beside(
    receiver: &mut Receiver<Probe>,
    endpoint: &str,
    raw_controls: usize,
) -> (Vec<String>, Vec<String>) {
    let mut honest: Vec<Peer> = (1..=2u64)
        .map(|tag| {
            let tag = tag.to_string();
            Peer::start(&["send", "--to", endpoint, "--count", "10", "--tag", &tag, "--pause-ms", "20"], Some(KEY))
        })
        .collect();
    let mut by_tag: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut raw: Vec<String> = Vec::new();
    let mut rejected = Vec::new();
    let mut bad = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let controls = |raw: &Vec<String>| raw.iter().filter(|n| *n == "raw-control").count();
    while by_tag.values().map(Vec::len).sum::<usize>() < 20 || controls(&raw) < raw_controls {
        assert!(
            Instant::now() < deadline,
            "honest {by_tag:?}, raw {raw:?} after 30 s; rejected {rejected:?}; errors {:?}",
            receiver.take_errors()
        );
        match receiver.recv_timeout(Duration::from_millis(200)) {
            Ok(probe) if probe.note.starts_with("raw") => raw.push(probe.note),
            Ok(probe) => {
                if !probe_ok(&probe) {
                    bad.push(probe.id);
                }
                by_tag.entry(probe.id >> 32).or_default().push(probe.id & 0xffff_ffff);
            }
            Err(Error::Rejected { reason, .. }) => rejected.push(reason),
            Err(Error::Timeout | Error::Disconnected) => {}
            Err(other) => panic!("recv: {other:?}"),
        }
    }
    assert!(bad.is_empty(), "honest messages with other bytes: {bad:?}");
    for tag in [1, 2] {
        assert_eq!(by_tag.get(&tag), Some(&(0..10).collect::<Vec<_>>()), "honest sender {tag}");
    }
    for peer in &mut honest {
        assert!(peer.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
    }
    // Give a late raw message time to show.
    loop {
        match receiver.recv_timeout(Duration::from_millis(300)) {
            Ok(probe) => raw.push(probe.note),
            Err(Error::Rejected { reason, .. }) => rejected.push(reason),
            Err(_) => break,
        }
    }
    assert_eq!(controls(&raw), raw_controls, "raw control messages: {raw:?}");
    (raw, rejected)
}

/// The receiver's errors, gathered until `enough` holds of them (5 s at most), then 300 ms more.
fn errors_until(receiver: &mut Receiver<Probe>, enough: impl Fn(&[Error]) -> bool) -> Vec<Error> {
    let mut errors = Vec::new();
    wait_for(Duration::from_secs(5), || {
        errors.extend(receiver.take_errors());
        enough(&errors)
    });
    std::thread::sleep(Duration::from_millis(300));
    errors.extend(receiver.take_errors());
    eprintln!("receiver errors: {errors:#?}");
    errors
}

/// The receiver still serves a new sender.
fn still_serving(receiver: &mut Receiver<Probe>, endpoint: &str) {
    let sender = connect::<Probe>(endpoint, KEY).unwrap();
    sender.send(&make_probe(77, 77, 1000).unwrap()).unwrap();
    let probe = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(probe.id == 77 && probe_ok(&probe));
}

/// An authenticated raw link that follows the protocol sends `payloads` as messages 1, 2, ...
fn raw_control(addr: SocketAddr, payloads: &[Vec<u8>]) -> TcpLink {
    let (control, _) = raw_link(addr, true);
    for (seq, payload) in (1..).zip(payloads) {
        control.send(&message(seq, Descriptors::default(), payload)).unwrap();
    }
    control
}

#[test]
fn malformed_records_after_the_handshake_close_only_their_connection() {
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let addr = addr_of(&endpoint);
    let control_payloads = [payload_of(raw_probe(201, "raw-control")), payload_of(raw_probe(202, "raw-control"))];
    let one_tensor = payload_of(Probe {
        id: 300,
        tensors: vec![Tensor::zeros(DType::U8, &[64]).unwrap()],
        expected: vec![0],
        note: "raw-unknown-chunk".into(),
    });
    let mut closing: Vec<(&str, TcpLink)> = Vec::new();
    let (link, _) = raw_link(addr, false);
    link.send(&random_bytes(1000)).unwrap();
    closing.push(("random record before Hello", link));
    let (link, _) = raw_link(addr, false);
    let h = hello(0);
    link.send(&h[..h.len() / 2]).unwrap();
    closing.push(("truncated Hello", link));
    let (link, _) = raw_link(addr, true);
    link.send(&random_bytes(1000)).unwrap();
    closing.push(("Hello, then a random record", link));
    let (link, _) = raw_link(addr, true);
    let whole = message(1, Descriptors::default(), &control_payloads[0]);
    link.send(&whole[..whole.len() * 2 / 3]).unwrap();
    closing.push(("Hello, then a truncated Message", link));
    let (link, _) = raw_link(addr, true);
    link.send(&[]).unwrap();
    closing.push(("Hello, then an empty record", link));
    // A record that promises 1 MiB and stops after 10 bytes: it must not hold anyone up.
    let mut stalled = handshake_by_hand(addr, KEY.as_bytes());
    stalled.write_all(&record(&hello(0))).unwrap();
    stalled.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    stalled.write_all(&[7; 10]).unwrap();
    // A well-formed message naming a chunk that does not exist: refused, typed.
    let (unknown, _) = raw_link(addr, true);
    let desc = one_view(Source::SameDevice { chunk: 999, offset: 0 });
    unknown.send(&message(1, desc, &one_tensor)).unwrap();
    // The control: a raw client that follows the protocol is served, so the attacks above were
    // judged on what they got wrong, not on the raw framing.
    let control = raw_control(addr, &control_payloads);

    let (raw, rejected) = serve_honest_beside(&mut receiver, &endpoint, 2);
    assert!(!raw.iter().any(|n| n == "raw-unknown-chunk"), "a tensor of an unknown chunk was delivered");
    let mut failures = Vec::new();
    for (name, link) in &closing {
        if let Err(why) = closed_within(link, Duration::from_secs(5)) {
            failures.push(format!("{name}: {why}"));
        }
    }
    // Each closed connection is reported, and the unknown chunk as a refusal of that message (or
    // of its connection), as typed errors.
    let closed = |errors: &[Error]| errors.iter().filter(|e| matches!(e, Error::ConnectionClosed { .. })).count();
    let errors = errors_until(&mut receiver, |e| closed(e) >= closing.len());
    let refused = !rejected.is_empty() || errors.iter().any(|e| matches!(e, Error::Rejected { .. }));
    if closed(&errors) + usize::from(refused) < closing.len() + 1 {
        failures.push(format!("{} closed connections and refused: {refused}: {errors:?}", closed(&errors)));
    }
    assert!(failures.is_empty(), "{failures:#?}");
    still_serving(&mut receiver, &endpoint);
    drop((stalled, control, unknown));
}

/// A message with NCCL transfers that cannot be received (here: its communicator was never set
/// up) closes its connection instead of being refused alone: its sender has queued those NCCL
/// sends already, and the next message's receives on that communicator would pair with them
/// (another message's bytes, or a hang). It is never delivered, the closing is reported, and
/// other senders are served.
#[test]
fn a_message_whose_nccl_transfers_cannot_be_received_closes_its_connection() {
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let addr = addr_of(&endpoint);
    let one_tensor = payload_of(Probe {
        id: 400,
        tensors: vec![Tensor::zeros(DType::U8, &[64]).unwrap()],
        expected: vec![0],
        note: "raw-nccl".into(),
    });
    let (liar, _) = raw_link(addr, true);
    let desc = one_view(Source::Nccl { communicator: 5 }); // a communicator never announced
    liar.send(&message(1, desc, &one_tensor)).unwrap();
    match receiver.recv_timeout(Duration::from_secs(2)) {
        Ok(probe) => panic!("a message whose NCCL transfer has no communicator was delivered: {}", probe.note),
        Err(Error::Rejected { reason, .. }) => panic!("refused alone, its NCCL sends would stay unpaired: {reason}"),
        Err(_) => {}
    }
    closed_within(&liar, Duration::from_secs(5)).expect("the connection is closed");
    let closed = |errors: &[Error]| {
        errors.iter().any(|e| {
            matches!(e, Error::ConnectionClosed { cause, .. }
                if matches!(**cause, Error::NcclMessageLost { seq: 1, .. }) && cause.to_string().contains("NCCL"))
        })
    };
    let errors = errors_until(&mut receiver, closed);
    assert!(closed(&errors), "the closing is reported with its reason: {errors:?}");
    still_serving(&mut receiver, &endpoint);
}

/// A sender that writes past its credits gains nothing and costs nobody: the receiver reads its
/// messages only as it takes them (never more than its capacity ahead), delivers them in order,
/// and serves an honest sender beside it meanwhile. (The first version of this test expected the
/// connection to be closed, as the spec then said; a receiver that reads lazily cannot tell a
/// sender that ran ahead from one that waited for its credits, and the spec now promises the
/// bound on memory instead: see `tensor_queue::channel`'s docs on flow control.)
#[test]
fn a_sender_past_its_credits_is_held_back_and_costs_nobody() {
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let addr = addr_of(&endpoint);
    let flood_payload = payload_of(raw_probe(100, "raw-flood"));
    let control_payloads = [payload_of(raw_probe(201, "raw-control")), payload_of(raw_probe(202, "raw-control"))];
    // Before anything is taken from the receiver (so no credit came back yet): four messages on
    // the four credits of its Hello, then ten more.
    let (flood, capacity) = raw_link(addr, true);
    assert_eq!(capacity, 4, "the receiver's Hello grants its capacity");
    for seq in 1..=u64::from(capacity) + 10 {
        if flood.send(&message(seq, Descriptors::default(), &flood_payload)).is_err() {
            break;
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let control = raw_control(addr, &control_payloads);
    let (raw, _) = serve_honest_beside(&mut receiver, &endpoint, 2);
    let controls = raw.iter().filter(|n| *n == "raw-control").count();
    assert_eq!(controls, 2, "the honest raw client beside the flood was served: {raw:?}");
    still_serving(&mut receiver, &endpoint);
    drop(control);
    drop(flood);
}

/// Records whose length prefix is over `ipc_core::tcp::MAX_MESSAGE` (written by hand: `TcpLink`
/// never sends one) close their connection, reported; nobody else notices.
#[test]
fn an_oversize_length_prefix_closes_the_connection() {
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let addr = addr_of(&endpoint);
    let control_payload = payload_of(raw_probe(201, "raw-control"));
    // The control, spoken as the attacks speak: handshake, Hello, its answer, a message.
    let mut by_hand = handshake_by_hand(addr, KEY.as_bytes());
    by_hand.write_all(&record(&hello(0))).unwrap();
    let mut answer = read_record(&mut by_hand);
    while Hello::decode(&answer).is_err() {
        answer = read_record(&mut by_hand);
    }
    by_hand.write_all(&record(&message(1, Descriptors::default(), &control_payload))).unwrap();
    let mut huge = handshake_by_hand(addr, KEY.as_bytes());
    huge.write_all(&record(&hello(0))).unwrap();
    huge.write_all(&u32::MAX.to_le_bytes()).unwrap();
    huge.write_all(&random_bytes(4096)).unwrap();
    let mut over = handshake_by_hand(addr, KEY.as_bytes());
    over.write_all(&record(&hello(0))).unwrap();
    over.write_all(&(MAX_MESSAGE as u32 + 1).to_le_bytes()).unwrap();
    serve_honest_beside(&mut receiver, &endpoint, 1);
    let mut failures = Vec::new();
    for (name, stream) in [("u32::MAX length prefix", &mut huge), ("MAX_MESSAGE + 1 length prefix", &mut over)] {
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        if let Err(error) = stream.read_to_end(&mut rest)
            && error.kind() != std::io::ErrorKind::ConnectionReset
        {
            failures.push(format!("{name}: not closed within 5 s: {error}"));
        }
    }
    let closed = |errors: &[Error]| errors.iter().filter(|e| matches!(e, Error::ConnectionClosed { .. })).count();
    let errors = errors_until(&mut receiver, |e| closed(e) >= 2);
    if closed(&errors) < 2 {
        failures.push(format!("{} of 2 connections reported closed: {errors:?}", closed(&errors)));
    }
    assert!(failures.is_empty(), "{failures:#?}");
    still_serving(&mut receiver, &endpoint);
    drop(by_hand);
}

/// The start of a run of host bytes as `ipc_core::tcp` writes it: a `u32::MAX` mark where a
/// record's length would be, then the run's length.
fn run_header(len: u64) -> Vec<u8> {
    let mut header = u32::MAX.to_le_bytes().to_vec();
    header.extend_from_slice(&len.to_le_bytes());
    header
}

/// Well-formed frames and runs of bytes that a sender on another host may not send where they
/// are each close their connection with the typed `Violation` that names what was wrong (the
/// cause of an `Error::ConnectionClosed`), and the receiver goes on serving.
#[test]
fn hostile_tcp_senders_are_closed_with_typed_violations() {
    use tensor_queue::Violation;
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let addr = addr_of(&endpoint);
    // A run of bytes before the sender's Hello.
    let mut before_hello = handshake_by_hand(addr, KEY.as_bytes());
    before_hello.write_all(&run_header(8)).unwrap();
    before_hello.write_all(&[1; 8]).unwrap();
    // Host bytes as a frame, not as a run.
    let (framed, _) = raw_link(addr, true);
    framed.send(&ToReceiver::Bytes { data: vec![1; 8] }.encode()).unwrap();
    // Two runs for one message.
    let mut two_runs = handshake_by_hand(addr, KEY.as_bytes());
    two_runs.write_all(&record(&hello(0))).unwrap();
    for _ in 0..2 {
        two_runs.write_all(&run_header(8)).unwrap();
        two_runs.write_all(&[2; 8]).unwrap();
    }
    // A run longer than a message may carry (its bytes never come).
    let mut too_long = handshake_by_hand(addr, KEY.as_bytes());
    too_long.write_all(&record(&hello(0))).unwrap();
    too_long.write_all(&run_header(MAX_INLINE_BYTES + 1)).unwrap();
    // A communicator for a GPU this process does not have (it has none here).
    let (absent_gpu, _) = raw_link(addr, true);
    let target = [9; 16];
    let unique_id = vec![7; ipc_core::nccl::UniqueId::LEN];
    absent_gpu.send(&ToReceiver::Communicator { id: 1, unique_id, target }.encode()).unwrap();

    let expected = [
        Violation::BulkOutOfPlace,
        Violation::FramedBytes,
        Violation::SecondBulkRun,
        Violation::BulkTooLong { len: MAX_INLINE_BYTES + 1 },
        Violation::CommunicatorForAbsentGpu { target: ipc_core::Uuid(target) },
    ];
    let mut errors = Vec::new();
    let violations = |errors: &[Error]| -> Vec<Violation> {
        errors
            .iter()
            .filter_map(|e| match e {
                Error::ConnectionClosed { cause, .. } => match &**cause {
                    Error::Violation(violation) => Some(violation.clone()),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !expected.iter().all(|v| violations(&errors).contains(v)) && Instant::now() < deadline {
        match receiver.recv_timeout(Duration::from_millis(100)) {
            Ok(probe) => panic!("a hostile sender's message was delivered: {}", probe.note),
            Err(Error::Timeout | Error::Disconnected) => {}
            Err(other) => errors.push(other),
        }
        errors.extend(receiver.take_errors());
    }
    let seen = violations(&errors);
    let missing: Vec<&Violation> = expected.iter().filter(|v| !seen.contains(v)).collect();
    assert!(missing.is_empty(), "not reported as typed violations: {missing:?}; errors: {errors:#?}");
    for (name, link) in [("framed bytes", &framed), ("a communicator for an absent GPU", &absent_gpu)] {
        closed_within(link, Duration::from_secs(5)).unwrap_or_else(|why| panic!("{name}: {why}"));
    }
    still_serving(&mut receiver, &endpoint);
    drop((before_hello, two_runs, too_long));
}

// ---------------------------------------------------------------------------------------------
// 5. Killed peers

#[test]
fn a_sender_killed_mid_stream_leaves_an_intact_prefix_then_disconnected() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let args = ["send", "--to", &endpoint, "--count", "100000", "--tag", "1", "--seed", "77", "--len", "262144"];
    let mut doomed = Peer::start(&args, Some(KEY));
    let mut next = 0u64;
    let check = |probe: Probe, next: &mut u64| {
        assert_eq!(probe.id, (1 << 32) | *next, "in order, none lost");
        assert!(probe_ok(&probe), "message {next}: other bytes");
        assert_eq!(probe.tensors[0].path(), TransferPath::Tcp);
        *next += 1;
    };
    receive_n(&mut receiver, 20, Duration::from_secs(30), |p: Probe, _| check(p, &mut next));
    doomed.kill();
    // What was sent before the kill, then Disconnected; never a torn message or a hang.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "no Disconnected 20 s after the kill ({next} received)");
        match receiver.recv_timeout(Duration::from_secs(1)) {
            Ok(probe) => check(probe, &mut next),
            Err(Error::Disconnected) => break,
            Err(Error::Timeout) => {}
            Err(other) => panic!("after {next} messages: {other:?}"),
        }
    }
    eprintln!("{next} messages arrived before the kill showed");
    // A new sender is accepted.
    let mut fresh = Peer::start(&["send", "--to", &endpoint, "--count", "3", "--tag", "2"], Some(KEY));
    let mut ids = Vec::new();
    receive_n(&mut receiver, 3, Duration::from_secs(30), |p: Probe, _| {
        assert!(probe_ok(&p));
        ids.push(p.id);
    });
    assert_eq!(ids, [2 << 32, (2 << 32) | 1, (2 << 32) | 2]);
    assert!(fresh.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

#[test]
fn a_killed_receiver_process_fails_send_with_disconnected() {
    let (mut doomed, endpoint) = Peer::receiver(&["--capacity", "4"]);
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    for id in 0..3 {
        sender.send(&make_probe(id, id, 4096).unwrap()).unwrap();
    }
    for (id, line) in doomed.got(3, Duration::from_secs(20)).iter().enumerate() {
        let (got, ok, path, pid) = parse_got(line);
        assert_eq!((got, ok, path.as_str(), pid), (id as u64, true, "Tcp", std::process::id()), "{line}");
    }
    assert!(sender.is_connected());
    doomed.kill();
    let outcome = within(Duration::from_secs(15), move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut id = 3;
        loop {
            if let Err(error) = sender.send(&make_probe(id, id, 4096).unwrap()) {
                return (Err(variant(&error)), sender);
            }
            if Instant::now() > deadline {
                return (Ok(id), sender);
            }
            id += 1;
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let (result, sender) = outcome.expect("send hung after the receiver was killed");
    assert_eq!(result, Err("Disconnected".to_string()), "sends 10 s after the receiver was killed");
    assert!(wait_for(Duration::from_secs(5), || !sender.is_connected()).is_some(), "is_connected after the kill");
}

/// The receiver dies while 16 MiB messages stream to it (a send is likely mid-write).
#[test]
fn a_receiver_killed_during_large_sends_fails_them_with_disconnected() {
    let (mut doomed, endpoint) = Peer::receiver(&["--capacity", "4"]);
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    let big = make_probe(0, 16, 16 << 20).unwrap();
    let (first_tx, first) = mpsc::channel();
    let outcome = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(40);
        let mut sent = 0u64;
        loop {
            if let Err(error) = sender.send(&big) {
                return (Err(variant(&error)), sent, sender);
            }
            sent += 1;
            let _ = first_tx.send(sent);
            if Instant::now() > deadline {
                return (Ok(()), sent, sender);
            }
        }
    });
    first.recv_timeout(Duration::from_secs(20)).expect("a first 16 MiB send");
    doomed.expect("got 0 ok Tcp", Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(50));
    doomed.kill();
    let killed = Instant::now();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(outcome.join());
    });
    let (result, sent, sender) = rx.recv_timeout(Duration::from_secs(45)).expect("the sending thread hung").unwrap();
    assert_eq!(result, Err("Disconnected".to_string()), "after {sent} sends");
    assert!(killed.elapsed() < Duration::from_secs(10), "the send noticed the kill only after {:?}", killed.elapsed());
    assert!(!sender.is_connected());
}

#[test]
fn a_send_blocked_on_a_full_queue_fails_when_the_receiver_is_killed() {
    let (mut doomed, endpoint) = Peer::receiver(&["--capacity", "2", "--idle"]);
    let sender = Arc::new(connect::<Probe>(&endpoint, KEY).unwrap());
    for id in 0..2 {
        sender.send_timeout(&make_probe(id, id, 4096).unwrap(), Duration::from_secs(10)).unwrap();
    }
    let blocked = sender.clone();
    let (result_tx, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = result_tx.send(blocked.send(&make_probe(2, 2, 4096).unwrap()).map_err(|e| variant(&e)));
    });
    assert!(result.recv_timeout(Duration::from_millis(500)).is_err(), "a third send went through a full queue");
    doomed.kill();
    let outcome = result.recv_timeout(Duration::from_secs(10));
    assert_eq!(outcome, Ok(Err("Disconnected".to_string())), "the blocked send after the kill");
    assert!(!sender.is_connected());
}

// ---------------------------------------------------------------------------------------------
// 6. Backpressure and sizes

#[test]
fn a_full_tcp_queue_reports_full_and_timeout_then_drains() {
    let (mut idle, endpoint) = Peer::receiver(&["--capacity", "2", "--idle"]);
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    let sender = within(Duration::from_secs(10), move || {
        for id in 0..2 {
            sender.send(&make_probe(id, id, 1 << 16).unwrap()).unwrap();
        }
        sender
    })
    .expect("two sends into a queue of two");
    // Host tensors over TCP are copied at send: nothing stays leased, though nothing was read.
    assert!(sender.wait_released(Duration::from_secs(5)), "{} leases out", sender.outstanding_leases());
    let full = sender.try_send(&make_probe(2, 2, 100).unwrap());
    assert!(matches!(full, Err(Error::Full)), "try_send on a full queue: {full:?}");
    let sender = Arc::new(sender);
    let timing = sender.clone();
    let timed = within(Duration::from_secs(5), move || {
        let start = Instant::now();
        let result = timing.send_timeout(&make_probe(3, 3, 100).unwrap(), Duration::from_millis(300));
        (result.map_err(|e| variant(&e)), start.elapsed())
    });
    let (result, took) = timed.expect("send_timeout(300 ms) returned within 5 s");
    assert_eq!(result, Err("Timeout".to_string()));
    assert!(took >= Duration::from_millis(250), "send_timeout gave up after {took:?}");
    assert!(sender.is_connected());
    idle.tell("read 2");
    let got: Vec<_> = idle.got(2, Duration::from_secs(20)).iter().map(|l| parse_got(l)).collect();
    assert_eq!(got, [(0, true, "Tcp".into(), std::process::id()), (1, true, "Tcp".into(), std::process::id())]);
    idle.expect("read-done 2", Duration::from_secs(10));
    // The credits came back over TCP: sends go through again; the refused two never arrive.
    let feeder = sender.clone();
    let sent = within(Duration::from_secs(15), move || {
        feeder.send_timeout(&make_probe(4, 4, 100).unwrap(), Duration::from_secs(10)).map_err(|e| variant(&e))
    });
    assert_eq!(sent, Some(Ok(())));
    idle.tell("read 1");
    let (id, ok, path, _) = parse_got(&idle.expect("got", Duration::from_secs(20)));
    assert_eq!(
        (id, ok, path.as_str()),
        (4, true, "Tcp"),
        "the messages refused by try_send/send_timeout were not sent"
    );
    idle.close_stdin();
    assert!(idle.exit_within(Duration::from_secs(10)).is_some());
}

#[test]
fn a_64_mib_host_tensor_crosses_tcp_both_ways_intact() {
    let len = 64 << 20;
    // From a sender process.
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let len_arg = len.to_string();
    let mut sender =
        Peer::start(&["send", "--to", &endpoint, "--count", "1", "--seed", "64", "--len", &len_arg], Some(KEY));
    let probe = receiver.recv_timeout(Duration::from_secs(40)).expect("64 MiB from a sender process");
    assert_eq!(probe.tensors[0].shape(), [len as u64]);
    assert_eq!(probe.tensors[0].path(), TransferPath::Tcp);
    assert_eq!(digest(&probe.tensors[0].to_bytes().unwrap()), digest(&reference::pattern(len, 64)));
    assert!(sender.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
    // To a receiver process.
    let (mut peer, endpoint) = Peer::receiver(&["--count", "1"]);
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    let big = make_probe(0, 65, len).unwrap();
    sender.send(&big).unwrap();
    assert!(sender.wait_released(Duration::from_secs(5)), "host tensors over TCP are copied at send");
    let (id, ok, path, _) = parse_got(&peer.expect("got", Duration::from_secs(40)));
    assert_eq!((id, ok, path.as_str()), (0, true, "Tcp"));
    assert!(peer.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

/// Over TCP the limit is `wire::MAX_INLINE_BYTES` of host bytes: a 300 MiB tensor is well
/// within it (though over the 256 MiB frame limit of Unix sockets).
#[test]
fn a_300_mib_host_tensor_crosses_tcp() {
    let len = 300 << 20;
    let (mut peer, endpoint) = Peer::receiver(&["--count", "1"]);
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    let big = make_probe(0, 300, len).unwrap();
    let sent = sender.send(&big);
    assert!(sent.is_ok(), "300 MiB, under MAX_INLINE_BYTES ({MAX_INLINE_BYTES}): {sent:?}");
    let (id, ok, path, _) = parse_got(&peer.expect("got", Duration::from_secs(45)));
    assert_eq!((id, ok, path.as_str()), (0, true, "Tcp"));
}

#[test]
fn a_message_over_the_tcp_limit_is_refused_at_send() {
    let (mut peer, endpoint) = Peer::receiver(&["--count", "1"]);
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    // 4 GiB + 4 KiB of host bytes in three distinct tensors (zeros: nothing is written).
    let half = 2u64 << 30;
    let tensors = vec![
        Tensor::zeros(DType::U8, &[half]).unwrap(),
        Tensor::zeros(DType::U8, &[half]).unwrap(),
        Tensor::zeros(DType::U8, &[4096]).unwrap(),
    ];
    let too_big = Probe { id: 0, tensors, expected: vec![0; 3], note: "too big".into() };
    let outcome = within(Duration::from_secs(40), move || {
        let result = sender.send(&too_big);
        (result, sender)
    });
    let (result, sender) = outcome.expect("send of a message over the limit returned within 40 s");
    match result {
        Err(Error::TooLarge { size, limit }) => {
            assert!(limit as u64 == MAX_INLINE_BYTES && size > limit, "size {size}, limit {limit}")
        }
        other => panic!("a message of 4 GiB + 4 KiB of host bytes: {other:?}"),
    }
    assert!(sender.is_connected(), "the connection goes on");
    sender.send(&make_probe(1, 1, 1000).unwrap()).unwrap();
    let (id, ok, _, _) = parse_got(&peer.expect("got", Duration::from_secs(20)));
    assert_eq!((id, ok), (1, true), "nothing of the refused message arrived");
}

// ---------------------------------------------------------------------------------------------
// 7. Broadcast over TCP and a Unix socket

#[test]
fn broadcast_reaches_two_tcp_receivers_and_a_unix_one() {
    const COUNT: u64 = 20;
    let count = COUNT.to_string();
    let (mut first, first_endpoint) = Peer::receiver(&["--count", &count]);
    let (mut second, second_endpoint) = Peer::receiver(&["--count", &count]);
    let path = socket_path("tcp-broadcast");
    let mut local = Peer::start(&["recv", "--bind", path.to_str().unwrap(), "--count", &count], None);
    local.expect("listening unix", Duration::from_secs(20));
    let senders = vec![
        connect::<Probe>(&first_endpoint, KEY).unwrap(),
        connect::<Probe>(&second_endpoint, KEY).unwrap(),
        Sender::<Probe>::connect(&path).unwrap(),
    ];
    let broadcast = Broadcast::new(senders);
    for id in 0..COUNT {
        let mut probe = make_probe(id, 4000 + id, 1000 + 1000 * id as usize).unwrap();
        // A strided view beside it.
        let matrix = Tensor::from_bytes(&reference::pattern(48 * 4, id), DType::F32, &[6, 8]).unwrap();
        let view = matrix.transpose(0, 1).unwrap();
        probe.expected.push(digest(&view.to_bytes().unwrap()));
        probe.tensors.push(view);
        broadcast.send(&probe).unwrap();
    }
    for (name, peer, path) in
        [("tcp 1", &mut first, "Tcp"), ("tcp 2", &mut second, "Tcp"), ("unix", &mut local, "HostSharedMemory")]
    {
        let got: Vec<_> = peer.got(COUNT as usize, Duration::from_secs(30)).iter().map(|l| parse_got(l)).collect();
        let expected: Vec<_> = (0..COUNT).map(|id| (id, true, path.to_string(), std::process::id())).collect();
        assert_eq!(got, expected, "{name}");
        peer.expect("done", Duration::from_secs(10));
        assert!(peer.exit_within(Duration::from_secs(10)).is_some_and(|s| s.success()), "{name}");
        assert!(!peer.drain().iter().any(|l| l.starts_with("recv-error")), "{name}: {:?}", peer.seen());
    }
    assert!(
        wait_for(Duration::from_secs(10), || broadcast.senders().iter().all(|s| s.outstanding_leases() == 0)).is_some(),
        "leases: {:?}",
        broadcast.senders().iter().map(Sender::outstanding_leases).collect::<Vec<_>>()
    );
}

// ---------------------------------------------------------------------------------------------
// The client side of `tq-auth-v1`, by hand from ipc-core::tcp's module docs, with SHA-256 and
// HMAC written out (the tests' crate has no crypto dependency).

/// Authenticates as a client with `key` over a fresh connection, and returns the raw stream.
fn handshake_by_hand(addr: SocketAddr, key: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let nonce = random_bytes(32);
    let mut greeting = b"tq-auth-v1C".to_vec();
    greeting.extend_from_slice(&nonce);
    stream.write_all(&greeting).unwrap();
    let mut theirs = [0u8; GREETING];
    stream.read_exact(&mut theirs).unwrap();
    assert_eq!(&theirs[..11], b"tq-auth-v1S");
    let server_nonce = &theirs[11..];
    stream.write_all(&hmac_sha256(key, &[b"tq-auth-v1C", &nonce, server_nonce])).unwrap();
    let mut answer = [0u8; 32];
    stream.read_exact(&mut answer).expect("the listener accepted the hand-made answer");
    assert_eq!(answer, hmac_sha256(key, &[b"tq-auth-v1S", server_nonce, &nonce]), "the listener's answer");
    stream
}

fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut block = if key.len() > 64 { sha256(key).to_vec() } else { key.to_vec() };
    block.resize(64, 0);
    let mut inner: Vec<u8> = block.iter().map(|b| b ^ 0x36).collect();
    for part in parts {
        inner.extend_from_slice(part);
    }
    let mut outer: Vec<u8> = block.iter().map(|b| b ^ 0x5c).collect();
    outer.extend_from_slice(&sha256(&inner));
    sha256(&outer)
}

fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
        0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
        0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
        0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
        0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
        0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
        0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] =
        [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];
    let mut message = data.to_vec();
    message.push(0x80);
    while message.len() % 64 != 56 {
        message.push(0);
    }
    message.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in message.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes(word.try_into().unwrap());
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[i]).wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            (hh, g, f, e, d, c, b, a) = (g, f, e, d.wrapping_add(t1), c, b, a, t1.wrapping_add(t2));
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

#[test]
fn the_hand_written_sha256_and_hmac_match_known_vectors() {
    let hex = |bytes: &[u8]| integration_tests::to_hex(bytes);
    assert_eq!(hex(&sha256(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    assert_eq!(hex(&sha256(&[b'a'; 1000])), "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3");
    // RFC 4231, test case 2.
    assert_eq!(
        hex(&hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"])),
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
}

/// A `send_timeout` whose deadline passes while a large host tensor's bytes are going out must
/// leave the channel whole: the message arrives whole or not at all, and the next message's
/// tensors are its own bytes, not leftovers of the one before. Found on review: the deadline
/// applied to each frame of the message, so a timeout at a frame boundary could strand some of
/// its bytes at the receiver, which then joined them to the next message's. (The race needs a
/// full socket exactly at a boundary after the deadline; these two tests did not hit it with the
/// old code on the CI machine, so they guard the property rather than reproduce the bug.)
#[test]
fn a_send_whose_deadline_passes_midway_leaves_the_channel_whole() {
    let (mut receiver, endpoint) = bind::<Vec<Tensor>>(4);
    let sender = connect::<Vec<Tensor>>(&endpoint, KEY).unwrap();
    sender.wait_ready(Duration::from_secs(10)).unwrap();
    let small: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
    let next = vec![Tensor::from_bytes(&small, DType::U8, &[4096]).unwrap()];
    let sending = std::thread::spawn(move || {
        // 64 MiB cannot all fit the sockets' buffers while nobody receives.
        let big = Tensor::from_bytes(&vec![0xAA; 64 << 20], DType::U8, &[64 << 20]).unwrap();
        let first = sender.send_timeout(&vec![big], Duration::from_millis(300));
        sender.send(&next).map(|()| first)
    });
    std::thread::sleep(Duration::from_secs(1)); // well past the deadline
    let mut got = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    if got[0].numel() == 64 << 20 {
        assert!(got[0].to_vec::<u8>().unwrap().iter().all(|&b| b == 0xAA), "the big message, whole");
        got = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    }
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].to_vec::<u8>().unwrap(), small, "the next message's own bytes");
    let first = sending.join().unwrap().unwrap();
    assert!(matches!(first, Ok(()) | Err(Error::Timeout)), "{first:?}");
}

/// The test above against a raw receiver that drains 64 KiB every 10 ms, checking the stream
/// itself: every run of host bytes that arrives belongs to the message after it, which
/// arrives; a message is written whole once begun (it fails only before its first byte).
#[test]
fn a_message_begun_is_finished_even_past_its_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let sending = std::thread::spawn(move || {
        let sender = connect::<Vec<Tensor>>(&endpoint, KEY).unwrap();
        sender.wait_ready(Duration::from_secs(10)).unwrap();
        let big = Tensor::from_bytes(&vec![0xAA; 32 << 20], DType::U8, &[32 << 20]).unwrap();
        let first = sender.send_timeout(&vec![big], Duration::from_millis(300));
        let small = Tensor::from_bytes(&[7u8; 4096], DType::U8, &[4096]).unwrap();
        sender.send(&vec![small]).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        first
    });
    let link = listener.accept(Some(Duration::from_secs(10)), &link_secret_of(KEY)).unwrap();
    let mut buf = Vec::new();
    link.recv(&mut buf, Some(Duration::from_secs(10))).unwrap();
    assert!(Hello::decode(&buf).is_ok());
    link.send(&hello(4)).unwrap();
    let mut assembler = Assembler::default();
    let (mut stranded, mut messages) = (0usize, 0usize);
    let started = Instant::now();
    while messages < 2 && started.elapsed() < Duration::from_secs(60) {
        // A slow reader (6 MB/s): the socket buffers fill, and the rest outlasts the deadline.
        match next_incoming(&link, &mut buf, Duration::from_millis(10)) {
            Ok(Incoming::Run) => {
                assert_eq!(stranded, 0, "one run of host bytes per message");
                stranded = buf.len();
                continue;
            }
            Ok(Incoming::Record) => {}
            Err(_) => break,
        }
        if let Some((ToReceiver::Message { tensors, .. }, _)) = assembler.push::<ToReceiver>(&buf, Vec::new()).unwrap()
        {
            let needed: u64 = tensors.storages().iter().map(|s| s.source.offset() + s.len).max().unwrap_or(0);
            assert_eq!(stranded as u64, needed, "message {messages}: the bytes before it are exactly its own");
            stranded = 0;
            messages += 1;
        }
    }
    let first = sending.join().unwrap();
    // Begun at once (the socket had room), so finished: the timeout never cut it.
    assert!(first.is_ok(), "{first:?}");
    assert_eq!(messages, 2, "both messages arrived");
}

// ---------------------------------------------------------------------------------------------
// Hostile and careless peers (issue 22): the hostile side is `tq-hostile`, a program of its own.

/// Starts `tq-hostile <args>` with `TQ_SECRET` set to `secret` (or unset).
fn hostile(args: &[&str], secret: Option<&str>) -> Peer {
    Peer::program("tq-hostile", args, secret)
}

/// Errors the receiver reports until `enough` holds of them (10 s at most), while it serves.
fn reported_until(receiver: &mut Receiver<Probe>, enough: impl Fn(&[Error]) -> bool) -> Vec<Error> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut reported = Vec::new();
    while !enough(&reported) && Instant::now() < deadline {
        let _ = receiver.recv_timeout(Duration::from_millis(50));
        reported.extend(receiver.take_errors());
    }
    reported
}

/// A sender killed with only part of one record of a message written (less than a packet: the
/// receiver's link holds the piece) leaves an entry in `take_errors` too (issue 21: the piece
/// was not counted, and the loss went unreported).
#[test]
fn a_tcp_sender_killed_mid_record_is_reported() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let mut doomed = hostile(&["half-record-tcp", &endpoint], Some(KEY));
    doomed.expect("ready", Duration::from_secs(60));
    // Read the hello and the half record before the kill.
    let _ = receiver.recv_timeout(Duration::from_millis(500));
    doomed.kill();
    let reported = reported_until(&mut receiver, |errors| errors.iter().any(is_unfinished));
    assert!(reported.iter().any(is_unfinished), "the lost message is reported: {reported:?}");
}

/// Hundreds of silent connections, from the honest sender's own address, cannot keep it out:
/// the oldest unfinished handshakes make room for new ones, and each one dropped is reported,
/// not blamed on the secret.
#[test]
fn silent_connections_cannot_lock_out_an_honest_sender() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let mut silent = hostile(&["silent-tcp", &endpoint, "300"], None);
    silent.expect("ready", Duration::from_secs(30));
    let sender = connect::<Probe>(&endpoint, KEY).expect("the honest sender is let in");
    sender.send(&make_probe(5, 5, 10).unwrap()).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().id, 5);
    let reported = reported_until(&mut receiver, |errors| {
        errors.iter().any(|e| matches!(e, Error::Core(ipc_core::Error::HandshakeShed { .. })))
    });
    assert!(
        reported.iter().any(|e| matches!(e, Error::Core(ipc_core::Error::HandshakeShed { .. }))),
        "dropped handshakes are reported: {reported:?}"
    );
    assert!(!reported.iter().any(|e| e.to_string().contains("TQ_SECRET")), "nobody blames the secret: {reported:?}");
    silent.close_stdin();
}

/// A consumer that spends longer than any timeout of the link (35 s) between two `recv`s, while
/// its sender has more queued than the sockets hold, only slows that sender: every message
/// arrives intact afterwards, and neither side is cut or reports anything.
#[test]
fn a_slow_tcp_consumer_only_slows_its_sender() {
    let (mut consumer, endpoint) = Peer::receiver(&["--idle"]);
    let sender = Arc::new(connect::<Probe>(&endpoint, KEY).unwrap());
    let sending = {
        let sender = sender.clone();
        std::thread::spawn(move || -> tensor_queue::Result<()> {
            for i in 0..6 {
                sender.send(&make_probe(i, i, 8 << 20).expect("a probe"))?;
            }
            Ok(())
        })
    };
    std::thread::sleep(Duration::from_secs(35));
    assert!(sender.is_connected(), "the sender was cut from a slow consumer");
    consumer.tell("read 6");
    let got = consumer.got(6, Duration::from_secs(60));
    assert!(got.iter().all(|line| parse_got(line).1), "{got:?}");
    sending.join().unwrap().expect("every send succeeds");
    sender.send(&make_probe(9, 9, 100).unwrap()).unwrap();
    consumer.tell("read 1");
    assert_eq!(parse_got(&consumer.expect("got", Duration::from_secs(30))).0, 9);
    assert!(!consumer.drain().iter().any(|l| l.starts_with("recv-error")), "{:?}", consumer.seen());
}

/// Resident memory of process `pid`, in bytes.
fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).and_then(|kib| kib.parse::<u64>().ok()).expect("a size") << 10
}

/// Record headers that claim the largest record and then send one byte cost the receiver what
/// arrived, not what they claimed: 32 such peers (16 MiB each, 512 MiB claimed) leave the
/// receiver process's memory near where it was, and it goes on serving.
#[test]
fn record_headers_that_claim_much_and_send_little_cost_what_arrived() {
    let (mut consumer, endpoint) = Peer::receiver(&[]);
    std::thread::sleep(Duration::from_millis(200));
    let before = rss_of(consumer.id());
    let mut claims = hostile(&["claim-tcp", &endpoint, "32"], Some(KEY));
    claims.expect("ready", Duration::from_secs(60));
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    sender.send(&make_probe(1, 1, 1000).unwrap()).unwrap();
    let (id, ok, _, _) = parse_got(&consumer.expect("got", Duration::from_secs(30)));
    assert_eq!((id, ok), (1, true), "the receiver goes on serving");
    let grown = rss_of(consumer.id()).saturating_sub(before);
    assert!(grown < 128 << 20, "the receiver grew by {} MiB for 32 one-byte records", grown >> 20);
    claims.close_stdin();
}

/// A sender that sends the parts of a frame and never its end, then stays connected and
/// silent, loses its connection once nothing more came for `UNFINISHED_IDLE`, and the receiver
/// reports the unfinished message (memory held by an unfinished frame does not outlive it).
#[test]
fn an_unfinished_frame_does_not_outlive_its_idle_bound() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let mut parts = hostile(&["parts-tcp", &endpoint, "20"], Some(KEY));
    let deadline = Instant::now() + tensor_queue::channel::UNFINISHED_IDLE + Duration::from_secs(30);
    let mut reported = Vec::new();
    while Instant::now() < deadline && !reported.iter().any(is_unfinished) {
        let _ = receiver.recv_timeout(Duration::from_millis(200));
        reported.extend(receiver.take_errors());
    }
    assert!(
        reported.iter().any(is_unfinished),
        "the idle unfinished frame is given up and reported: {reported:?}; the sender said {:?}",
        parts.drain()
    );
    let said = parts.drain().to_vec();
    assert!(said.iter().any(|l| l == "ready"), "it sent its parts and stays: {said:?}");
    let idle =
        |e: &Error| matches!(e, Error::ConnectionClosed { cause, .. } if cause.to_string().contains("nothing more"));
    assert!(reported.iter().any(idle), "given up for idleness, not a hang-up: {reported:?}");
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    sender.send(&make_probe(3, 3, 1000).unwrap()).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().id, 3, "others are served");
    parts.close_stdin();
}

fn is_unfinished(error: &Error) -> bool {
    matches!(error, Error::ConnectionClosed { cause, .. } if matches!(**cause, Error::Unfinished { .. }))
}

/// A sender killed in the middle of a message leaves an entry in the receiver's `take_errors`:
/// the receiver can tell a death mid-message from a clean goodbye (issue 21, item 3).
#[test]
fn a_tcp_sender_killed_mid_message_is_reported() {
    let (mut receiver, endpoint) = bind::<Probe>(8);
    let mut doomed = hostile(&["mid-message-tcp", &endpoint], Some(KEY));
    doomed.expect("ready", Duration::from_secs(60));
    // Read up to the middle of the message before the kill.
    let _ = receiver.recv_timeout(Duration::from_millis(500));
    doomed.kill();
    let reported = reported_until(&mut receiver, |errors| errors.iter().any(is_unfinished));
    assert!(reported.iter().any(is_unfinished), "the lost message is reported: {reported:?}");
    // A clean goodbye reports nothing.
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    sender.send(&make_probe(4, 4, 1000).unwrap()).unwrap();
    assert_eq!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().id, 4);
    drop(sender);
    assert!(matches!(receiver.recv_timeout(Duration::from_secs(10)), Err(Error::Disconnected)));
    assert!(receiver.take_errors().is_empty(), "a clean goodbye is not a loss");
}

// ---------------------------------------------------------------------------------------------
// Host tensors' bytes as one bulk run per message (issue 26): written straight from the
// tensors' memory, read straight into the memory they land in.

/// `len` bytes of a pattern that differs for every (message, tensor, byte).
fn pattern(message: u64, tensor: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| (i.wrapping_mul(31) ^ tensor.wrapping_mul(7) ^ message.wrapping_mul(131)) as u8).collect()
}

/// Many host tensors in one message, of odd sizes and at odd offsets (views into a shared
/// buffer, an empty one, one of several MiB, a transposed one), in several messages: every byte
/// arrives where it belongs, and the sender's memory is released once the bytes are out.
#[test]
fn many_host_tensors_of_odd_sizes_cross_tcp_intact() {
    let (mut receiver, endpoint) = bind::<Vec<Tensor>>(4);
    let messages = 3u64;
    let sending = std::thread::spawn(move || {
        let sender = connect::<Vec<Tensor>>(&endpoint, KEY).unwrap();
        let mut expected = Vec::new();
        for m in 0..messages {
            let mut tensors = Vec::new();
            let mut bytes = Vec::new();
            let mut seed = 0x9e37_79b9u64 ^ m;
            for t in 0..300u64 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let len = (seed >> 33) as usize % 9001; // 0..=9000 bytes, odd ones among them
                let data = pattern(m, t, len + 13);
                let whole = Tensor::from_bytes(&data, DType::U8, &[data.len() as u64]).unwrap();
                // A view at an odd offset, sharing its storage with the rest of the buffer.
                let view = whole.narrow(0, 13, len as u64).unwrap();
                bytes.push(data[13..].to_vec());
                tensors.push(view);
            }
            let big = pattern(m, 1000, (5 << 20) + 3);
            tensors.push(Tensor::from_bytes(&big, DType::U8, &[big.len() as u64]).unwrap());
            bytes.push(big);
            let square = pattern(m, 1001, 17 * 19);
            let transposed = Tensor::from_bytes(&square, DType::U8, &[17, 19]).unwrap().transpose(0, 1).unwrap();
            bytes.push(transposed.to_bytes().unwrap());
            tensors.push(transposed);
            sender.send(&tensors).unwrap();
            expected.push(bytes);
        }
        assert!(sender.wait_released(Duration::from_secs(30)), "the sent bytes were written and released");
        expected
    });
    let mut got = Vec::new();
    for _ in 0..messages {
        let tensors = receiver.recv_timeout(Duration::from_secs(60)).unwrap();
        got.push(tensors.iter().map(|t| t.to_bytes().unwrap()).collect::<Vec<_>>());
    }
    let expected = sending.join().unwrap();
    for (m, (got, expected)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(got.len(), expected.len(), "message {m}: tensors");
        for (t, (got, expected)) in got.iter().zip(expected).enumerate() {
            assert!(got == expected, "message {m}, tensor {t}: {} bytes, expected {}", got.len(), expected.len());
        }
    }
}

/// A host tensor's descriptor table as a lying or honest raw sender writes it: `len` bytes at
/// `offset` of the message's run.
fn tcp_desc(offset: u64, len: u64) -> Descriptors {
    let mut tensors = Descriptors::default();
    let storage = tensors.push_storage(StorageDesc { source: Source::Bytes { offset }, len, fence: Fence::None });
    tensors.push_tensor(storage, 0, DType::U8, &[len], &[1]);
    tensors
}

/// A bulk run of `bytes`.
fn run_of(bytes: &[u8]) -> ipc_core::tcp::Bulk {
    ipc_core::tcp::Bulk::new(vec![ipc_core::tcp::Piece::Owned(bytes.to_vec())], Box::new(())).unwrap()
}

/// Sends `run` on a raw link, whole.
fn send_run(link: &TcpLink, mut run: ipc_core::tcp::Bulk) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match link.try_send_bulk(run).unwrap() {
            Ok(()) => return,
            Err(back) => run = back,
        }
        assert!(Instant::now() < deadline, "the receiver took no run");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A sender whose run of host bytes does not match its descriptors (shorter than they claim;
/// none at all; one over the limit) gets those messages refused, typed, and nothing else lost:
/// its honest message after them arrives with its own bytes, and other senders are served.
#[test]
fn host_bytes_that_do_not_match_their_descriptors_are_refused_alone() {
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let addr = addr_of(&endpoint);
    let probe = |id: u64, note: &str| {
        payload_of(Probe {
            id,
            tensors: vec![Tensor::zeros(DType::U8, &[64]).unwrap()],
            expected: vec![0],
            note: note.into(),
        })
    };
    let (short, lying) = (probe(500, "raw-short-run"), probe(501, "raw-no-run"));
    let honest = probe(502, "raw-after-lies");
    let (link, capacity) = raw_link(addr, true);
    assert!(capacity >= 3, "capacity {capacity}");
    // A run of 32 bytes, and a descriptor that reads 64.
    send_run(&link, run_of(&[1; 32]));
    link.send(&message(1, tcp_desc(0, 64), &short)).unwrap();
    // A host tensor and no run at all.
    link.send(&message(2, tcp_desc(0, 64), &lying)).unwrap();
    // Then an honest one: its own bytes, not the lies' leftovers.
    let mine: Vec<u8> = (0..64).collect();
    send_run(&link, run_of(&mine));
    link.send(&message(3, tcp_desc(0, 64), &honest)).unwrap();

    let mut rejected = Vec::new();
    let mut delivered = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while delivered.is_empty() && Instant::now() < deadline {
        match receiver.recv_timeout(Duration::from_millis(200)) {
            Ok(probe) => delivered.push(probe),
            Err(Error::Rejected { reason, .. }) => rejected.push(reason),
            Err(Error::Timeout) => {}
            Err(other) => panic!("recv: {other:?}; errors {:?}", receiver.take_errors()),
        }
    }
    assert_eq!(rejected.len(), 2, "both lies refused: {rejected:?}");
    assert!(rejected[0].contains("brought 32"), "{rejected:?}");
    assert_eq!(delivered.len(), 1, "the honest message: {delivered:?}");
    assert_eq!(delivered[0].note, "raw-after-lies");
    assert_eq!(delivered[0].tensors[0].to_bytes().unwrap(), mine, "its own bytes");
    let errors = receiver.take_errors();
    assert!(errors.iter().all(|e| matches!(e, Error::Rejected { .. })), "the connection went on: {errors:?}");

    // A run longer than a message may carry closes its connection (nothing is allocated for
    // it), typed, and the receiver serves the next sender.
    let (huge, _) = raw_link(addr, true);
    let mut header = u32::MAX.to_le_bytes().to_vec();
    header.extend_from_slice(&(MAX_INLINE_BYTES + 1).to_le_bytes());
    let mut raw = std::fs::File::from(std::os::fd::AsFd::as_fd(&huge).try_clone_to_owned().unwrap());
    raw.write_all(&header).unwrap();
    let errors = errors_until(&mut receiver, |e| e.iter().any(|e| matches!(e, Error::ConnectionClosed { .. })));
    assert!(errors.iter().any(|e| matches!(e, Error::ConnectionClosed { .. })), "{errors:?}");
    closed_within(&huge, Duration::from_secs(10)).unwrap();
    still_serving(&mut receiver, &endpoint);
    drop(link);
}

// ---------------------------------------------------------------------------------------------
// Small messages' GPU tensors inline (issue 26): what can be checked without a GPU. The GPU
// side is in `cross_gpu.rs` (`small_messages_inline_*`).

/// A raw listener that plays a receiver on another host with one GPU (`gpu`) and `routing`: it
/// says its `Hello` to the first sender and holds the link until the returned sender is
/// dropped. The endpoint, for real senders.
fn fake_gpu_receiver(gpu: tensor_queue::Uuid, routing: tensor_queue::route::Routing) -> (String, mpsc::Sender<()>) {
    use tensor_queue::testing::{DeviceReach, Reach};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let (done, until) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let link = listener.accept(Some(Duration::from_secs(10)), &link_secret_of(KEY)).unwrap();
        let mut buf = Vec::new();
        link.recv(&mut buf, Some(Duration::from_secs(10))).unwrap();
        assert!(Hello::decode(&buf).is_ok(), "a TCP sender begins with Hello");
        let mut hello = integration_tests::raw::hello(4, 0x6a);
        hello.reach = Reach { devices: vec![DeviceReach { uuid: gpu, stream_ops: true }], links: vec![] };
        hello.routing = routing;
        link.send(&hello.encode()).unwrap();
        let _ = until.recv_timeout(Duration::from_secs(60));
    });
    (endpoint, done)
}

/// A sender to a receiver on another host with a GPU reports, per message size, the route its
/// GPU tensors take: inline over TCP onto the receiver's GPU up to its threshold (the default,
/// or the one it was built with; 0: never), NCCL above it or where the receiver refuses staging,
/// and bytes into host memory where the receiver asked for host tensors.
#[test]
fn the_route_of_a_small_message_across_hosts_is_inline_up_to_the_threshold() {
    use tensor_queue::route::{
        DEFAULT_INLINE_GPU_UP_TO, INLINE_GPU_ENV, Landing, Route, Routing, SMALL_MESSAGE_INLINE, Strictness,
    };
    let (theirs, mine) = (tensor_queue::Uuid([5; 16]), tensor_queue::Uuid([9; 16]));
    let wait = Duration::from_secs(10);
    let default_up_to = match std::env::var(INLINE_GPU_ENV) {
        Ok(value) => value.parse().expect("a number in the environment"),
        Err(_) => DEFAULT_INLINE_GPU_UP_TO,
    };

    let (endpoint, _hold) = fake_gpu_receiver(theirs, Routing::default());
    let sender = connect::<Probe>(&endpoint, KEY).unwrap();
    assert_eq!(sender.inline_gpu_up_to(), default_up_to);
    let large = sender.route(&mine, wait).unwrap();
    assert_eq!((large.route, large.target, large.reason), (Route::Nccl, Some(theirs), None));
    if default_up_to >= 4096 {
        let small = sender.route_for(&mine, 4096, wait).unwrap();
        assert_eq!((small.route, small.target), (Route::Tcp, Some(theirs)), "onto the GPU NCCL would use");
        assert_eq!(small.reason.as_deref(), Some(SMALL_MESSAGE_INLINE));
        assert_eq!(small.slower_because, None);
        let at = sender.route_for(&mine, default_up_to, wait).unwrap();
        assert_eq!(at.route, Route::Tcp, "at most the threshold");
    }
    let above = sender.route_for(&mine, default_up_to + 1, wait).unwrap();
    assert_eq!((above.route, above.reason), (Route::Nccl, None), "just above the threshold");

    let (endpoint, _hold) = fake_gpu_receiver(theirs, Routing::default());
    let sender =
        Sender::<Probe>::builder().secret(secret_of(KEY)).inline_gpu_up_to(1 << 20).connect(&endpoint).unwrap();
    assert_eq!(sender.inline_gpu_up_to(), 1 << 20);
    assert_eq!(sender.route_for(&mine, 1 << 20, wait).unwrap().route, Route::Tcp);
    assert_eq!(sender.route_for(&mine, (1 << 20) + 1, wait).unwrap().route, Route::Nccl);

    let (endpoint, _hold) = fake_gpu_receiver(theirs, Routing::default());
    let never = Sender::<Probe>::builder().secret(secret_of(KEY)).inline_gpu_up_to(0).connect(&endpoint).unwrap();
    assert_eq!(never.route_for(&mine, 1, wait).unwrap().route, Route::Nccl, "0: always NCCL");

    let (endpoint, _hold) = fake_gpu_receiver(theirs, Routing::default().strict(Strictness::NoStaging));
    let strict =
        Sender::<Probe>::builder().secret(secret_of(KEY)).inline_gpu_up_to(1 << 20).connect(&endpoint).unwrap();
    assert_eq!(strict.route_for(&mine, 16, wait).unwrap().route, Route::Nccl, "no staging through host memory");

    let (endpoint, _hold) = fake_gpu_receiver(theirs, Routing::default().land(Landing::Host));
    let host = connect::<Probe>(&endpoint, KEY).unwrap();
    let choice = host.route_for(&mine, 16, wait).unwrap();
    assert_eq!((choice.route, choice.target, choice.reason), (Route::Tcp, None, None), "host tensors, asked for");
}

/// A threshold a message's bytes could never hold, given in code or in the environment (or not
/// a number there), is refused at `connect` with `Error::Invalid`, before any connection.
#[test]
fn an_inline_threshold_out_of_range_or_not_a_number_is_refused_at_connect() {
    use tensor_queue::route::{INLINE_GPU_ENV, MAX_INLINE_GPU_UP_TO};
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let refused =
        Sender::<Probe>::builder().secret(secret_of(KEY)).inline_gpu_up_to(MAX_INLINE_GPU_UP_TO + 1).connect(&endpoint);
    assert!(matches!(&refused, Err(Error::Invalid(why)) if why.contains("inline_gpu_up_to")), "{:?}", refused.err());
    for value in ["lots", "-1", &(MAX_INLINE_GPU_UP_TO + 1).to_string()] {
        let args = ["send", "--to", &endpoint, "--count", "1"];
        let mut peer = Peer::program_env("tcp-peer", &args, Some(KEY), &[(INLINE_GPU_ENV, value)]);
        let line = peer.expect("error", Duration::from_secs(20));
        assert!(line.starts_with("error Invalid") && line.contains(INLINE_GPU_ENV), "{INLINE_GPU_ENV}={value}: {line}");
        assert!(peer.exit_within(Duration::from_secs(10)).is_some_and(|s| !s.success()));
    }
    // A number in range is taken; the receiver saw nothing of the refused ones.
    let mut fine = Peer::program_env(
        "tcp-peer",
        &["send", "--to", &endpoint, "--count", "1"],
        Some(KEY),
        &[(INLINE_GPU_ENV, "0")],
    );
    fine.expect("sent 1", Duration::from_secs(20));
    let probe = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(probe_ok(&probe));
    assert!(receiver.take_errors().is_empty());
}

/// A sender that names a GPU this receiver lacks for a small message's inline bytes (this one
/// has none) gets that message refused, typed, and nothing else lost: its next message arrives.
#[test]
fn inline_bytes_for_a_gpu_the_receiver_lacks_are_refused_alone() {
    let (mut receiver, endpoint) = bind::<Probe>(4);
    let addr = addr_of(&endpoint);
    let probe = |id: u64, note: &str| {
        payload_of(Probe {
            id,
            tensors: vec![Tensor::zeros(DType::U8, &[64]).unwrap()],
            expected: vec![0],
            note: note.into(),
        })
    };
    let (lying, honest) = (probe(600, "raw-absent-gpu"), probe(601, "raw-after-absent-gpu"));
    let (link, _) = raw_link(addr, true);
    let mut to_gpu = Descriptors::default();
    let source = Source::BytesToGpu { offset: 0, target: tensor_queue::Uuid([0xee; 16]) };
    let storage = to_gpu.push_storage(StorageDesc { source, len: 64, fence: Fence::None });
    to_gpu.push_tensor(storage, 0, DType::U8, &[64], &[1]);
    send_run(&link, run_of(&[7; 64]));
    link.send(&message(1, to_gpu, &lying)).unwrap();
    let mine: Vec<u8> = (0..64).collect();
    send_run(&link, run_of(&mine));
    link.send(&message(2, tcp_desc(0, 64), &honest)).unwrap();
    let mut rejected = Vec::new();
    let mut delivered = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while delivered.is_empty() && Instant::now() < deadline {
        match receiver.recv_timeout(Duration::from_millis(200)) {
            Ok(probe) => delivered.push(probe),
            Err(Error::Rejected { reason, .. }) => rejected.push(reason),
            Err(Error::Timeout) => {}
            Err(other) => panic!("recv: {other:?}; errors {:?}", receiver.take_errors()),
        }
    }
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(rejected[0].contains("not one of this process's"), "{rejected:?}");
    assert_eq!(delivered.len(), 1);
    assert_eq!(delivered[0].tensors[0].to_bytes().unwrap(), mine, "its own bytes");
    drop(link);
}

/// Outside round 7's B2: hundreds of honest senders of one host connecting at once (a pool of
/// workers starting together) all get in, though the receiver sheds handshakes beyond 16 at
/// once from one address: a shed connector is told so, or sees a hang-up in the greeting, and
/// tries again; a handshake is never shed once the connector was let in. Before, a quarter of
/// them failed with `AuthFailed`, which blames the secret, and at 300 some were let in and then
/// cut off (their first send `Disconnected`).
#[test]
fn hundreds_of_senders_connecting_at_once_all_get_in() {
    const SENDERS: u64 = 300;
    let (mut receiver, endpoint) = bind::<u64>(8);
    // A pool: the stream ends when all of them have come and gone, not in a moment between.
    receiver.expect_senders(SENDERS as usize);
    let start = Arc::new(std::sync::Barrier::new(SENDERS as usize));
    let senders: Vec<_> = (0..SENDERS)
        .map(|i| {
            let (start, endpoint) = (start.clone(), endpoint.clone());
            std::thread::spawn(move || {
                start.wait();
                let sender = Sender::<u64>::builder()
                    .secret(secret_of(KEY))
                    .timeout(Duration::from_secs(60))
                    .connect(endpoint.as_str())?;
                sender.send(&i)?;
                sender.wait_released(Duration::from_secs(60));
                Ok::<_, Error>(())
            })
        })
        .collect();
    let mut got = std::collections::BTreeSet::new();
    while got.len() < SENDERS as usize {
        got.insert(receiver.recv_timeout(Duration::from_secs(60)).expect("a message from every sender"));
    }
    for sender in senders {
        sender.join().unwrap().expect("every sender got in and sent");
    }
    assert_eq!(got, (0..SENDERS).collect());
}
