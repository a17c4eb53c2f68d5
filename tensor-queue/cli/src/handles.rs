//! Which GPU handle kinds cross between two real processes here: this process exports, a second
//! `tq` (started by exec as `tq doctor-child`, never forked after CUDA is initialised) imports
//! and uses, over a socket pair that is the child's standard input.
//!
//! The protocol: one request a message, a tag byte and the handle's bytes (a VMM allocation's
//! descriptor travels beside them); the child answers `ok <import ns> <word>` or `err <why>`.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_core::seqpacket::Connection;
use ipc_core::{DeviceBuffer, DeviceMemory, Event, ImportedIpcMemory, IpcEventHandle, IpcMemHandle, VmmAllocation};
use serde::Serialize;
use tensor_queue::testing::Reach;
use tensor_queue::{Context, Device, Stream, Uuid};

use crate::output::warn;
use crate::text::table;
use crate::verdict::Verdict;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The word the exporter writes and the importer must read back ("tqdoctor").
const MAGIC: u64 = 0x7471_646f_6374_6f72;
/// The word the child writes with a stream memory operation.
const CHILD_WORD: u64 = 0x6368_696c_6477_7264;
/// How long a child may take to answer one request (the first includes its CUDA start-up).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Timed repetitions per handle kind with `--measure` (after one that warms up).
const REPEATS: usize = 5;

/// One handle kind and whether it crossed.
#[derive(Clone, Debug, Serialize)]
pub struct HandleRow {
    /// `legacy_ipc_memory`, `vmm_fd`, `interprocess_event` or `stream_memory_ops`.
    pub kind: &'static str,
    /// The kind in words.
    pub label: &'static str,
    /// How it stands.
    pub verdict: Verdict,
    /// What happened.
    pub detail: String,
    /// What to do about it.
    pub fix: Option<String>,
    /// With `--measure`: the median cost of exporting one, in microseconds.
    pub export_us: Option<f64>,
    /// With `--measure`: the median cost of importing (or, for stream memory operations, of
    /// one write and synchronize in the other process), in microseconds.
    pub import_us: Option<f64>,
}

/// The handle kinds: tag, JSON name, words.
const KINDS: [(u8, &str, &str); 4] = [
    (b'L', "legacy_ipc_memory", "legacy IPC memory handle"),
    (b'V', "vmm_fd", "VMM file descriptor"),
    (b'E', "interprocess_event", "interprocess event"),
    (b'S', "stream_memory_ops", "stream memory operations"),
];

/// Rows saying every kind was not checked, and why.
pub fn skipped(why: &str) -> Vec<HandleRow> {
    KINDS
        .iter()
        .map(|&(_, kind, label)| HandleRow {
            kind,
            label,
            verdict: Verdict::Skipped,
            detail: why.to_string(),
            fix: None,
            export_us: None,
            import_us: None,
        })
        .collect()
}

/// Tries every kind between this process and a child, on GPU 0.
pub fn check(measure: bool) -> Vec<HandleRow> {
    let setup = || -> Result<(Helper, Arc<Context>), BoxError> { Ok((Helper::start()?, Context::on_ordinal(0)?)) };
    let (helper, context) = match setup() {
        Ok(ready) => ready,
        Err(error) => {
            let mut rows = skipped("");
            for row in &mut rows {
                row.verdict = Verdict::Broken;
                row.detail = format!("the second process could not be started: {error}");
                row.fix =
                    Some("check that the tq binary can run itself (std::env::current_exe) and GPU 0 works".into());
            }
            return rows;
        }
    };
    let stream_ops = Reach::local().devices.first().is_some_and(|d| d.stream_ops);
    let mut rows = Vec::new();
    for &(tag, kind, label) in &KINDS {
        let mut row = HandleRow {
            kind,
            label,
            verdict: Verdict::Ok,
            detail: String::new(),
            fix: None,
            export_us: None,
            import_us: None,
        };
        if tag == b'S' && !stream_ops {
            row.verdict = Verdict::SlowerThanPossible;
            row.detail = "GPU 0 has no 64-bit stream memory operations".into();
            row.fix = Some(
                "tensor-queue orders received tensors with interprocess events instead (about 20 times slower to wait \
                 on): update the driver (older ones need the nvidia module option NVreg_EnableStreamMemOPs=1)"
                    .into(),
            );
            rows.push(row);
            continue;
        }
        let runs = if measure { 1 + REPEATS } else { 1 };
        let mut costs = Vec::new();
        let mut failure = None;
        for _ in 0..runs {
            match try_kind(tag, &context, &helper) {
                Ok(cost) => costs.push(cost),
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        match failure {
            Some(error) => {
                row.verdict = Verdict::Broken;
                row.detail = error.to_string();
                row.fix = Some(fix_for(tag).into());
            }
            None => {
                row.detail = "exported here, imported and used in a second process".into();
                if measure {
                    let timed = &costs[1..];
                    row.export_us = median(timed.iter().filter_map(|c| c.0));
                    row.import_us = median(timed.iter().map(|c| c.1));
                }
            }
        }
        rows.push(row);
    }
    helper.finish();
    rows
}

fn fix_for(tag: u8) -> &'static str {
    match tag {
        b'L' => "legacy IPC needs both processes in one IPC namespace on the same GPU: in containers use --ipc=host",
        b'V' => {
            "VMM descriptors need a driver with cuMemExportToShareableHandle (CUDA 10.2+) and descriptor passing \
                 over Unix sockets (no seccomp block on SCM_RIGHTS)"
        }
        b'E' => "interprocess events need both processes in one IPC namespace (--ipc=host)",
        _ => "stream memory operations on imported memory failed: update the driver",
    }
}

fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut values: Vec<f64> = values.collect();
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

/// One export here and one import there: (export cost, import cost) in microseconds.
fn try_kind(tag: u8, context: &Arc<Context>, helper: &Helper) -> Result<(Option<f64>, f64), BoxError> {
    let stream = Stream::new(context)?;
    match tag {
        b'L' | b'S' => {
            let buffer = DeviceBuffer::alloc(context, 1 << 20)?;
            stream.copy_from_host_async(&buffer, 0, &MAGIC.to_le_bytes())?;
            stream.synchronize()?;
            let start = Instant::now();
            let handle = buffer.export()?;
            let export = micros(start);
            let (import, word) = helper.request(tag, &handle.to_bytes(), None)?;
            if tag == b'L' {
                expect_word(word, MAGIC)?;
                return Ok((Some(export), import));
            }
            // The child wrote its word with a stream memory operation and synchronised.
            expect_word(stream.read_value64(&buffer, 0)?, CHILD_WORD)?;
            Ok((None, import))
        }
        b'V' => {
            let memory = VmmAllocation::new(context, 1)?;
            stream.copy_from_host_async(&memory, 0, &MAGIC.to_le_bytes())?;
            stream.synchronize()?;
            let start = Instant::now();
            let fd = memory.export()?;
            let export = micros(start);
            let mut bytes = (memory.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(&context.device().uuid()?.0);
            let (import, word) = helper.request(tag, &bytes, Some(fd))?;
            expect_word(word, MAGIC)?;
            Ok((Some(export), import))
        }
        _ => {
            let event = Event::interprocess(context)?;
            event.record(&stream)?;
            let start = Instant::now();
            let handle = event.export()?;
            let export = micros(start);
            let (import, _) = helper.request(tag, &handle.to_bytes(), None)?;
            Ok((Some(export), import))
        }
    }
}

fn expect_word(found: u64, expected: u64) -> Result<(), BoxError> {
    if found != expected {
        return Err(format!("the other process read {found:#x} where {expected:#x} was written").into());
    }
    Ok(())
}

fn micros(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e6
}

/// The second process and our end of its socket.
struct Helper {
    child: std::process::Child,
    connection: Connection,
}

impl Helper {
    fn start() -> Result<Helper, BoxError> {
        let (ours, theirs) = Connection::pair()?;
        let stdin = theirs.as_fd().try_clone_to_owned()?;
        drop(theirs);
        let child = Command::new(std::env::current_exe()?)
            .arg("doctor-child")
            .stdin(Stdio::from(stdin))
            .stdout(Stdio::null())
            .spawn()?;
        ours.set_recv_timeout(Some(ANSWER_TIMEOUT))?;
        Ok(Helper { child, connection: ours })
    }

    /// Sends one request and returns the child's (import cost in µs, word read).
    fn request(&self, tag: u8, bytes: &[u8], fd: Option<OwnedFd>) -> Result<(f64, u64), BoxError> {
        let mut message = vec![tag];
        message.extend_from_slice(bytes);
        let fds: Vec<_> = fd.iter().map(|fd| fd.as_fd()).collect();
        self.connection.send(&message, &fds)?;
        let mut buf = [0u8; 4096];
        let (n, _) = self.connection.recv(&mut buf)?;
        if n == 0 {
            return Err("the second process exited without answering".into());
        }
        parse_answer(&String::from_utf8_lossy(&buf[..n]))
    }

    /// Hangs up (the child then exits) and reaps the child, killing it if it lingers.
    fn finish(mut self) {
        drop(self.connection);
        for _ in 0..50 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child's answer: `ok <import ns> <word>` or `err <why>`.
fn parse_answer(answer: &str) -> Result<(f64, u64), BoxError> {
    if let Some(why) = answer.strip_prefix("err ") {
        return Err(why.to_string().into());
    }
    let mut words = answer.strip_prefix("ok ").ok_or("a malformed answer")?.split(' ');
    let nanos: u64 = words.next().ok_or("no cost")?.parse()?;
    let word: u64 = words.next().ok_or("no word")?.parse()?;
    Ok((nanos as f64 / 1e3, word))
}

/// `tq doctor-child`: answers the doctor's requests on standard input until it hangs up.
pub fn child_main() -> ExitCode {
    let connection = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => Connection::from(fd),
        Err(error) => {
            warn(&format!(
                "tq doctor-child: no socket on standard input ({error}); this command is started by `tq doctor`"
            ));
            return ExitCode::from(2);
        }
    };
    // Every device's primary context, held for the child's life: an import would otherwise
    // create the context (about 100 ms) and measure that instead of the import.
    let _contexts: Vec<Arc<Context>> =
        (0..Device::count().unwrap_or(0)).filter_map(|ordinal| Context::on_ordinal(ordinal).ok()).collect();
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, fds) = match connection.recv(&mut buf) {
            Ok((0, _)) => return ExitCode::SUCCESS,
            Ok(received) => received,
            Err(error) => {
                warn(&format!("tq doctor-child: {error}; this command is started by `tq doctor`"));
                return ExitCode::from(2);
            }
        };
        let answer = match serve(&buf[..n], fds) {
            Ok((nanos, word)) => format!("ok {nanos} {word}"),
            Err(error) => format!("err {error}"),
        };
        if connection.send(answer.as_bytes(), &[]).is_err() {
            return ExitCode::SUCCESS;
        }
    }
}

/// Imports and uses one handle: (import nanoseconds, word read).
fn serve(message: &[u8], mut fds: Vec<OwnedFd>) -> Result<(u128, u64), BoxError> {
    let (&tag, bytes) = message.split_first().ok_or("an empty request")?;
    match tag {
        b'L' | b'S' => {
            let handle = IpcMemHandle::from_bytes(bytes)?;
            let start = Instant::now();
            let memory = ImportedIpcMemory::open(&handle)?;
            let mut nanos = start.elapsed().as_nanos();
            let stream = Stream::new(memory.context())?;
            if tag == b'L' {
                return Ok((nanos, stream.read_value64(&memory, 0)?));
            }
            let start = Instant::now();
            stream.write_value64(&memory, 0, CHILD_WORD)?;
            stream.wait_value64(&memory, 0, CHILD_WORD)?;
            stream.synchronize()?;
            nanos = start.elapsed().as_nanos();
            Ok((nanos, 0))
        }
        b'V' => {
            let (len, uuid) = bytes.split_at_checked(8).ok_or("a short VMM request")?;
            let len = u64::from_le_bytes(len.try_into()?) as usize;
            let uuid = Uuid(uuid.try_into()?);
            let context = Context::primary(Device::by_uuid(&uuid)?)?;
            let fd = fds.pop().ok_or("no descriptor came with the VMM request")?;
            let start = Instant::now();
            let memory = VmmAllocation::import(&context, fd.as_raw_fd(), len)?;
            let nanos = start.elapsed().as_nanos();
            let stream = Stream::new(&context)?;
            Ok((nanos, stream.read_value64(&memory, 0)?))
        }
        b'E' => {
            let handle = IpcEventHandle::from_bytes(bytes)?;
            let start = Instant::now();
            let event = Event::import(&handle)?;
            let nanos = start.elapsed().as_nanos();
            let stream = Stream::new(event.context())?;
            stream.wait_event(&event)?;
            stream.synchronize()?;
            Ok((nanos, 0))
        }
        other => Err(format!("unknown request {other}").into()),
    }
}

/// The handle kinds as a table (costs only where measured).
pub fn handles_table(rows: &[HandleRow], width: usize) -> String {
    let measured = rows.iter().any(|r| r.import_us.is_some());
    let mut headers = vec!["verdict", "kind"];
    if measured {
        headers.extend(["export us", "import us"]);
    }
    headers.push("detail");
    let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    table(
        &headers,
        rows.iter().map(|row| {
            let mut cells = vec![row.verdict.label().to_string(), row.label.to_string()];
            if measured {
                cells.extend([us(row.export_us), us(row.import_us)]);
            }
            cells.push(row.detail.clone());
            cells
        }),
        width,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse() {
        assert_eq!(parse_answer("ok 1500 42").unwrap(), (1.5, 42));
        assert_eq!(parse_answer("err no GPU").unwrap_err().to_string(), "no GPU");
        assert!(parse_answer("garbage").is_err());
    }

    #[test]
    fn skipped_rows_cover_every_kind_and_do_not_fail_strict() {
        let rows = skipped("no GPU");
        let kinds: Vec<&str> = rows.iter().map(|r| r.kind).collect();
        assert_eq!(kinds, ["legacy_ipc_memory", "vmm_fd", "interprocess_event", "stream_memory_ops"]);
        assert!(rows.iter().all(|r| r.verdict == Verdict::Skipped));
    }

    #[test]
    fn the_median_is_the_middle() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), Some(2.0));
        assert_eq!(median(std::iter::empty()), None);
    }
}
