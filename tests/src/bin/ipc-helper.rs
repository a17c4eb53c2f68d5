//! The second process of the integration tests and benchmarks.
//!
//! `ipc-helper <command> [--skip-wait] --socket <path>`: connects to the test at `<path>`, then
//! does one job and answers with little-endian `u64`s. Tests start it as a fresh process, so no
//! process ever forks after CUDA is initialised.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use integration_tests::{decode_u64s, encode_u64s};
use ipc_core::seqpacket::Connection;
use ipc_core::{
    Context, Device, Event, ImportedIpcMemory, IpcEventHandle, IpcMemHandle, SharedMemory, Stream, Uuid, VmmAllocation,
};
use kernels::Kernels;

fn main() {
    if let Err(error) = run() {
        eprintln!("ipc-helper: {error:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = args.first().context("usage: ipc-helper <command> --socket <path>")?.clone();
    if command == "driver-status" {
        return driver_status();
    }
    let socket = args
        .iter()
        .position(|a| a == "--socket")
        .and_then(|i| args.get(i + 1))
        .context("--socket <path> is required")?;
    let skip_wait = args.iter().any(|a| a == "--skip-wait");
    let connection = Connection::connect(socket)?;
    match command.as_str() {
        "shm-check" => shm_check(&connection),
        "legacy-import" => legacy_import(&connection),
        "vmm-import" => vmm_import(&connection),
        "event-wait" => event_wait(&connection, skip_wait),
        "bench-open" => bench_open(&connection),
        "bench-vmm" => bench_vmm(&connection),
        "bench-event" => bench_event(&connection),
        other => bail!("unknown command {other}"),
    }
}

/// Prints what loading the driver gives: used to show a missing driver is an error, not a crash.
fn driver_status() -> Result<()> {
    // SAFETY: cuInit has no pointer arguments.
    match unsafe { cuda_sys::driver!(cuInit(0)) } {
        Ok(()) => println!("driver ok"),
        Err(error) => println!("driver error: {error}"),
    }
    Ok(())
}

/// One message, with a buffer large enough for every message of this protocol.
fn recv(connection: &Connection) -> Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>)> {
    let mut buf = vec![0u8; 1 << 16];
    let (n, fds) = connection.recv(&mut buf)?;
    if n == 0 {
        bail!("the test hung up");
    }
    buf.truncate(n);
    Ok((buf, fds))
}

fn reply(connection: &Connection, values: &[u64]) -> Result<()> {
    Ok(connection.send(&encode_u64s(values), &[])?)
}

fn context_for(uuid: &[u8]) -> Result<Arc<Context>> {
    let uuid = Uuid(uuid.try_into().context("a 16-byte device UUID")?);
    Ok(Context::primary(Device::by_uuid(&uuid)?)?)
}

/// Maps a shared-memory file, checks its pattern, then writes the next seed's pattern into it.
fn shm_check(connection: &Connection) -> Result<()> {
    let (bytes, mut fds) = recv(connection)?;
    let [len, seed] = decode_u64s(&bytes)[..] else { bail!("expected [len, seed]") };
    let fd = fds.pop().context("expected a descriptor")?;
    let memory = SharedMemory::from_fd(fd, len as usize)?;
    let mut bytes = vec![0u8; len as usize];
    memory.read(0, &mut bytes)?;
    let sum = kernels::reference::checksum(&bytes);
    memory.write(0, &kernels::reference::pattern(len as usize, seed + 1))?;
    reply(connection, &[sum])
}

/// Opens a legacy IPC handle and checksums the memory on this process's GPU stream.
fn legacy_import(connection: &Connection) -> Result<()> {
    let (bytes, _) = recv(connection)?;
    let handle = IpcMemHandle::from_bytes(&bytes)?;
    let memory = ImportedIpcMemory::open(&handle)?;
    let stream = Stream::new(ipc_core::DeviceMemory::context(&memory))?;
    let kernels = Kernels::get(stream.context())?;
    let sum = kernels.checksum(&memory, 0, handle.len(), &stream)?;
    reply(connection, &[sum])
}

/// Imports a VMM file descriptor ([len, uuid] + fd) and checksums it on the GPU.
fn vmm_import(connection: &Connection) -> Result<()> {
    let (bytes, mut fds) = recv(connection)?;
    let len = decode_u64s(&bytes[..8])[0] as usize;
    let context = context_for(&bytes[8..24])?;
    let fd = fds.pop().context("expected a descriptor")?;
    let memory = VmmAllocation::import(&context, fd.as_raw_fd(), len)?;
    drop(fd);
    let stream = Stream::new(&context)?;
    let sum = Kernels::get(&context)?.checksum(&memory, 0, len, &stream)?;
    reply(connection, &[sum])
}

/// Gets ready (context, kernels), says so, then receives a memory and an event handle, orders its
/// stream after the event (unless told to skip) and checksums the memory.
fn event_wait(connection: &Connection, skip_wait: bool) -> Result<()> {
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    let kernels = Kernels::get(&context)?;
    reply(connection, &[1])?;
    let (bytes, _) = recv(connection)?;
    let split = IpcMemHandle::ENCODED_LEN;
    let handle = IpcMemHandle::from_bytes(&bytes[..split])?;
    let memory = ImportedIpcMemory::open(&handle)?;
    let event = Event::import(&IpcEventHandle::from_bytes(&bytes[split..])?)?;
    if !skip_wait {
        stream.wait_event(&event)?;
    }
    let sum = kernels.checksum(&memory, 0, handle.len(), &stream)?;
    reply(connection, &[sum])
}

fn elapsed_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

/// For each legacy handle received: time `cuIpcOpenMemHandle` and `cuIpcCloseMemHandle`.
fn bench_open(connection: &Connection) -> Result<()> {
    // Like any receiver, hold the device's context: otherwise closing the last mapping would
    // destroy it and every open would pay for a new one.
    let _context = Context::on_ordinal(0)?;
    loop {
        let (bytes, _) = recv(connection)?;
        if bytes == b"done" {
            return Ok(());
        }
        let handle = IpcMemHandle::from_bytes(&bytes)?;
        let start = Instant::now();
        let memory = ImportedIpcMemory::open(&handle)?;
        let open = elapsed_ns(start);
        let start = Instant::now();
        drop(memory);
        let close = elapsed_ns(start);
        reply(connection, &[open, close])?;
    }
}

/// For each VMM descriptor received: time import, reserve, map and set access.
fn bench_vmm(connection: &Connection) -> Result<()> {
    let mut context = None;
    loop {
        let (bytes, mut fds) = recv(connection)?;
        if bytes == b"done" {
            return Ok(());
        }
        let len = decode_u64s(&bytes[..8])[0] as usize;
        let context = match &context {
            Some(context) => context,
            None => context.insert(context_for(&bytes[8..24])?),
        };
        let fd = fds.pop().context("expected a descriptor")?;
        let start = Instant::now();
        let memory = VmmAllocation::import(context, fd.as_raw_fd(), len)?;
        let import = elapsed_ns(start);
        drop(memory);
        reply(connection, &[import])?;
    }
}

/// Opens an interprocess event and times `cuStreamWaitEvent` + `cuStreamSynchronize` on it
/// (already complete) `[count]` times.
fn bench_event(connection: &Connection) -> Result<()> {
    let (bytes, _) = recv(connection)?;
    let event = Event::import(&IpcEventHandle::from_bytes(&bytes)?)?;
    let stream = Stream::new(event.context())?;
    let (count_bytes, _) = recv(connection)?;
    let count = decode_u64s(&count_bytes)[0];
    let mut times = Vec::new();
    for _ in 0..count {
        let start = Instant::now();
        stream.wait_event(&event)?;
        stream.synchronize()?;
        times.push(elapsed_ns(start));
    }
    reply(connection, &times)
}
