//! Shared pieces of the integration tests: starting the helper binary as a second process with a
//! connected socket, small message encodings, and the GPU skip rule; [`queue`] holds the messages
//! of the tensor-queue tests, [`outside_messages`] those of the outside tests of what users send
//! ([`outside6`]: round 6's ways of waiting and many-tensor messages; [`outside7`]: round 7's
//! mixed-size TCP streams);
//! [`talk`] is a helper program a test talks to by lines, [`raw`] a peer that speaks the wire by
//! hand, and [`program`] holds what those helper programs share.

pub mod cross;
pub mod outside6;
pub mod outside7;
pub mod outside_messages;
pub mod program;
pub mod queue;
pub mod raw;
pub mod talk;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};

use ipc_core::seqpacket::{Connection, Listener};

/// Environment variable naming the folder that holds `ipc-helper` (the GPU bundle sets it).
pub const BIN_DIR_ENV: &str = "IPC_TESTS_BIN_DIR";

/// The environment variable that turns on the library's `tracing` events on stderr, at the level
/// it names (`error`, `warn`, `info`, `debug`, `trace`), with a wall-clock time to the microsecond
/// and the thread, so the lines of two processes can be merged. Read by [`init_logging`].
pub const LOG_ENV: &str = "TQ_LOG";

/// Prints the library's `tracing` events on stderr if [`LOG_ENV`] names a level; a helper program
/// calls it first thing. An unknown level is said once and ignored.
pub fn init_logging() {
    let Some(level) = std::env::var_os(LOG_ENV) else { return };
    let Ok(level) = level.to_string_lossy().parse::<tracing_subscriber::filter::LevelFilter>() else {
        eprintln!("{LOG_ENV}={level:?}: not a level (error, warn, info, debug, trace)");
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_thread_names(true)
        .try_init();
}

/// Why GPU tests cannot run here, or `None` when a GPU is usable.
pub fn gpu_skip_reason() -> Option<String> {
    if cuda_sys::is_available() {
        return None;
    }
    Some(match cuda_sys::library() {
        Err(error) => format!("no GPU here: {error}"),
        Ok(driver) => format!("no GPU here: {} loaded but cuInit found no usable device", driver.path()),
    })
}

/// A test that needs `gpus` GPUs.
pub struct GpuTest {
    /// The test's name.
    pub name: &'static str,
    /// GPUs it needs.
    pub gpus: usize,
    /// The test.
    pub run: fn() -> Result<()>,
}

/// Environment variable naming a file where each GPU test binary appends how many tests it
/// skipped and why (`cargo xtask test` sets it and prints one line for the whole run).
pub const GPU_SKIPS_ENV: &str = "TQ_GPU_SKIPS";

/// Runs GPU tests as a libtest-style harness: where the machine lacks the GPUs a test needs, it
/// is reported as `ignored, <reason>`, never as passed. Without any GPU the reason is given once,
/// at the end (or in [`GPU_SKIPS_ENV`]'s file), not on every test's line.
pub fn run_gpu_tests(tests: Vec<GpuTest>) -> ! {
    use libtest_mimic::{Arguments, Completion, Failed, Trial};
    use std::sync::atomic::{AtomicUsize, Ordering};
    static SKIPPED: AtomicUsize = AtomicUsize::new(0);
    let no_gpu = gpu_skip_reason();
    let trials = tests
        .into_iter()
        .map(|GpuTest { name, gpus, run }| {
            let no_gpu = no_gpu.is_some();
            Trial::ignorable_test(name, move || match gpu_shortfall(gpus) {
                Some(_) if no_gpu => {
                    SKIPPED.fetch_add(1, Ordering::Relaxed);
                    Ok(Completion::ignored_with("no GPU"))
                }
                Some(reason) => Ok(Completion::ignored_with(reason)),
                None => {
                    eprintln!("[starting {name}]");
                    run().map(|()| Completion::Completed).map_err(|e| Failed::from(format!("{e:#}")))
                }
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&Arguments::from_args(), trials);
    if let Some(reason) = no_gpu {
        note_gpu_skips(SKIPPED.load(Ordering::Relaxed), &reason);
    }
    conclusion.exit()
}

/// Says once that `skipped` GPU tests were skipped for `reason`: in [`GPU_SKIPS_ENV`]'s file
/// where it is set (`cargo xtask test` sums them up), else on stdout.
pub fn note_gpu_skips(skipped: usize, reason: &str) {
    if skipped == 0 {
        return;
    }
    let noted = std::env::var_os(GPU_SKIPS_ENV).is_some_and(|file| {
        use std::io::Write;
        let file = std::fs::OpenOptions::new().create(true).append(true).open(file);
        file.and_then(|mut f| writeln!(f, "{skipped}\t{reason}")).is_ok()
    });
    if !noted {
        println!("{skipped} GPU tests skipped: {reason}");
    }
}

/// Why `gpus` GPUs are not available here, or `None`.
fn gpu_shortfall(gpus: usize) -> Option<String> {
    if let Some(reason) = gpu_skip_reason() {
        return Some(reason);
    }
    match ipc_core::Device::count() {
        Ok(count) if count as usize >= gpus => None,
        Ok(count) => Some(format!("needs {gpus} GPUs, this machine has {count}")),
        Err(error) => Some(format!("no GPU here: {error}")),
    }
}

/// The `ipc-helper` binary.
pub fn helper_path() -> Result<PathBuf> {
    bin_path("ipc-helper")
}

/// A binary of this crate: from [`BIN_DIR_ENV`], else next to (or one above) this executable.
pub fn bin_path(name: &str) -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV) {
        return Ok(PathBuf::from(dir).join(name));
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable without a folder")?;
    [dir.join(name), dir.join("..").join(name)]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| format!("{name} not found near {} (build it, or set {BIN_DIR_ENV})", exe.display()))
}

/// A unique socket path in the temporary folder.
pub fn socket_path(tag: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("ipc-tests-{}-{tag}-{n}.sock", std::process::id()))
}

/// A running helper process and the connection to it.
pub struct Helper {
    /// The helper process.
    pub child: Child,
    /// The connection it made back.
    pub connection: Connection,
    _listener: Listener,
}

impl Helper {
    /// Starts `ipc-helper <args> --socket <path>` and waits for it to connect.
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Result<Helper> {
        let path = socket_path(args.first().copied().unwrap_or("helper"));
        let listener = Listener::bind(&path)?;
        let mut command = Command::new(helper_path()?);
        command.args(args).arg("--socket").arg(&path).stdin(Stdio::null());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().context("starting ipc-helper")?;
        let connection = match listener.accept(Some(Duration::from_secs(60))) {
            Ok(connection) => connection,
            Err(error) => {
                let _ = child.kill();
                bail!("ipc-helper did not connect: {error} (exit: {:?})", child.wait());
            }
        };
        connection.set_recv_timeout(Some(Duration::from_secs(120)))?;
        Ok(Helper { child, connection, _listener: listener })
    }

    /// Receives one message of little-endian `u64`s.
    pub fn recv_u64s(&self) -> Result<Vec<u64>> {
        let mut buf = vec![0u8; 1 << 16];
        let (n, _) = self.connection.recv(&mut buf)?;
        if n == 0 {
            bail!("ipc-helper hung up");
        }
        Ok(decode_u64s(&buf[..n]))
    }

    /// Waits for the helper to exit successfully.
    pub fn finish(mut self) -> Result<()> {
        let status = self.child.wait()?;
        if !status.success() {
            bail!("ipc-helper exited with {status}");
        }
        Ok(())
    }
}

/// Encodes `u64`s little-endian.
pub fn encode_u64s(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Decodes little-endian `u64`s (a trailing partial value is ignored).
pub fn decode_u64s(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect()
}

/// Bytes as lowercase hexadecimal, for ids passed on a command line or a pipe.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The bytes of lowercase or uppercase hexadecimal.
pub fn from_hex(text: &str) -> Result<Vec<u8>> {
    let text = text.trim();
    if !text.len().is_multiple_of(2) {
        bail!("odd-length hexadecimal");
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).with_context(|| format!("bad hexadecimal at {i}")))
        .collect()
}

/// The in-process floor of a message of `tensors` (host or GPU: no byte is touched), `rounds`
/// (warm-up, measured) times: per measured round, the ns from the message's encoding to its
/// decoding with the tensors made again (the decoded message is dropped after the clock stops,
/// as a receiver's is after `recv`).
pub fn serde_floor_ns(tensors: &[tensor_queue::Tensor], (warmup, measured): (usize, usize)) -> Result<Vec<u64>> {
    let message = tensors.to_vec();
    let mut times = Vec::with_capacity(measured);
    for round in 0..warmup + measured {
        let start = tensor_queue::monotonic_ns();
        let again = tensor_queue::testing::serde_floor(&message)?;
        let took = tensor_queue::monotonic_ns() - start;
        anyhow::ensure!(again.len() == message.len(), "{} tensors came back of {}", again.len(), message.len());
        drop(again);
        if round >= warmup {
            times.push(took);
        }
    }
    Ok(times)
}

/// Nanoseconds as microseconds, for printing.
pub fn micros(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// The p-th percentile (0..=100) of `values` (sorted in place).
pub fn percentile(values: &mut [u64], p: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    values.sort_unstable();
    let rank = ((p / 100.0) * (values.len() - 1) as f64).round() as usize;
    values[rank.min(values.len() - 1)]
}

/// The value after `name` in a helper binary's arguments.
pub fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// The number after `name` in a helper binary's arguments, or `default`.
pub fn number(args: &[String], name: &str, default: u64) -> Result<u64> {
    arg(args, name).map_or(Ok(default), |v| v.parse().with_context(|| format!("{name} {v}")))
}

/// The lines a child prints on its (piped) standard output, read by a thread of their own so
/// that a test can wait for one with a timeout; each is echoed to stderr with `tag` when given.
pub fn stdout_lines(child: &mut Child, tag: Option<String>) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, lines) = std::sync::mpsc::channel();
    if let Some(stdout) = child.stdout.take() {
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(std::result::Result::ok) {
                if let Some(tag) = &tag {
                    eprintln!("[{tag}] {line}");
                }
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    lines
}

/// What `f` returns, run on a thread of its own; a panic naming `what` if it takes longer than
/// `bound` (a hang fails the test instead of holding it up).
pub fn within<R: Send + 'static>(bound: std::time::Duration, what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(bound) {
        Ok(value) => value,
        Err(_) => panic!("{what} did not return within {bound:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_and_percentiles() {
        assert_eq!(decode_u64s(&encode_u64s(&[1, u64::MAX, 7])), vec![1, u64::MAX, 7]);
        let mut values: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&mut values, 50.0), 51);
        assert_eq!(percentile(&mut values, 99.0), 99);
        assert_eq!(percentile(&mut [], 50.0), 0);
        assert_eq!(from_hex(&to_hex(&[0, 1, 0xab, 0xff])).unwrap(), vec![0, 1, 0xab, 0xff]);
        assert!(from_hex("abc").is_err() && from_hex("zz").is_err());
    }
}
