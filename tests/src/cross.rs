//! Messages and checks shared by the cross-device tests (`tests/tests/cross_gpu.rs`,
//! `tests/tests/routes_host.rs`) and their second process, `tq-cross`.
//!
//! Data is checked by a checksum of a tensor's elements in row-major order: computed on the GPU
//! by the producer (after it synchronised) and by the consumer (on the received tensor's stream),
//! and on the CPU from the same pattern through the same view calls on a host tensor.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use ipc_core::{DeviceBuffer, Stream};
use kernels::{Kernels, StridedLayout, reference};
use serde::{Deserialize, Serialize};
use tensor_queue::route::{Landing, PeerMode, Routing, Strictness};
use tensor_queue::{DType, Tensor, TensorDevice, Uuid};

/// One message of the cross-device tests.
#[derive(Serialize, Deserialize)]
pub struct CrossItem {
    /// Message number (per producing thread: `thread << 32 | index`).
    pub id: u64,
    /// `data` (tensors to check) or `verdict` (no tensors: the producer's checksums of an
    /// earlier message's tensors, known only after it synchronised).
    pub kind: String,
    /// The tensors.
    pub tensors: Vec<Tensor>,
    /// Per tensor, the producer's own GPU checksum of its elements (row-major), when known at
    /// send time; for a `verdict`, those of message `id`'s tensors.
    pub checksums: Vec<u64>,
    /// Per tensor, the checksum the CPU computed from the same pattern and view calls (empty
    /// when the producer has none).
    pub reference: Vec<u64>,
    /// What the tensors are, for messages.
    pub note: String,
}

/// What the consumer says of one message (a JSON line after `report `).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct MsgReport {
    /// The message's number.
    pub id: u64,
    /// Its kind.
    pub kind: String,
    /// Its sequence number on its connection.
    pub seq: u64,
    /// The sender's process id.
    pub pid: u32,
    /// Per tensor: `TransferPath` as text.
    pub paths: Vec<String>,
    /// Per tensor: `host` or the GPU's UUID where the bytes are.
    pub devices: Vec<String>,
    /// Per tensor: the UUID of the GPU its stream is on (`none` for host tensors).
    pub stream_devices: Vec<String>,
    /// Per tensor: the consumer's checksum (on the GPU for GPU tensors).
    pub seen: Vec<u64>,
    /// Per tensor: the producer's checksum sent with it.
    pub producer: Vec<u64>,
    /// Per tensor: the CPU reference sent with it.
    pub reference: Vec<u64>,
    /// Per tensor: shape and strides as received.
    pub layouts: Vec<String>,
    /// Whether every tensor's checksum equals the producer's and the reference (where given).
    pub ok: bool,
    /// Whether any tensor said `producer_failed()`.
    pub producer_failed: bool,
    /// The message's note.
    pub note: String,
}

/// The row-major checksum of a GPU tensor's elements, computed on the GPU on `stream` (whose
/// device must be able to read the tensor's memory): strided views are packed first by the pack
/// kernel into a buffer of the stream's device. Blocks until it is known.
pub fn gpu_checksum(tensor: &Tensor, stream: &Stream) -> Result<u64> {
    let kernels = Kernels::get(stream.context())?;
    let view = tensor.cuda_view()?;
    if tensor.nbytes() == 0 {
        return Ok(reference::checksum(&[]));
    }
    if tensor.is_contiguous() {
        return Ok(kernels.checksum(&view, 0, tensor.nbytes(), stream)?);
    }
    ensure!(tensor.strides().iter().all(|&s| s >= 0), "negative strides are not checked here");
    let layout = StridedLayout::new(tensor.shape(), tensor.strides(), tensor.dtype().size())?;
    let packed = DeviceBuffer::alloc(stream.context(), tensor.nbytes())?;
    kernels.pack(&view, 0, &layout, &packed, 0, stream)?;
    Ok(kernels.checksum(&packed, 0, tensor.nbytes(), stream)?)
}

/// The checksum of a received tensor's elements: on the GPU, on its stream, after waiting up to
/// `within` for that stream to pass the producer's work (`None`: it did not); host tensors on the
/// CPU.
pub fn received_checksum(tensor: &Tensor, within: Duration) -> Result<Option<u64>> {
    match tensor.device() {
        TensorDevice::Host => Ok(Some(reference::checksum(&tensor.to_bytes()?))),
        TensorDevice::Cuda(_) => {
            let stream = tensor.stream().context("a received GPU tensor has a stream")?;
            let start = Instant::now();
            while !stream.is_idle()? {
                if start.elapsed() > within {
                    return Ok(None);
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            gpu_checksum(tensor, stream).map(Some)
        }
    }
}

/// `host` or the GPU's UUID.
pub fn device_name(device: TensorDevice) -> String {
    match device {
        TensorDevice::Host => "host".into(),
        TensorDevice::Cuda(uuid) => uuid.to_string(),
    }
}

/// A routing policy from a consumer's arguments: `--land as-sent|host|<uuid>`, any number of
/// `--land-from <uuid>=host|<uuid>`, `--peer copy|map`, `--strict any|no-staging|zero-copy`.
pub fn routing_from_args(args: &[String]) -> Result<Routing> {
    let mut routing = Routing::default();
    if let Some(land) = crate::arg(args, "--land") {
        routing = routing.land(landing(&land)?);
    }
    for (i, a) in args.iter().enumerate() {
        if a == "--land-from" {
            let spec = args.get(i + 1).context("--land-from <uuid>=<landing>")?;
            let (source, land) = spec.split_once('=').context("--land-from <uuid>=<landing>")?;
            routing = routing.land_from(source.parse::<Uuid>()?, landing(land)?);
        }
    }
    if let Some(peer) = crate::arg(args, "--peer") {
        routing = routing.peer(match peer.as_str() {
            "copy" => PeerMode::Copy,
            "map" => PeerMode::Map,
            other => bail!("--peer {other}: copy or map"),
        });
    }
    if let Some(strict) = crate::arg(args, "--strict") {
        routing = routing.strict(match strict.as_str() {
            "any" => Strictness::Any,
            "no-staging" => Strictness::NoStaging,
            "zero-copy" => Strictness::ZeroCopy,
            other => bail!("--strict {other}: any, no-staging or zero-copy"),
        });
    }
    Ok(routing)
}

fn landing(text: &str) -> Result<Landing> {
    Ok(match text {
        "as-sent" => Landing::AsSent,
        "host" => Landing::Host,
        uuid => Landing::Device(uuid.parse::<Uuid>()?),
    })
}

/// A host tensor of `[rows, cols]` `i32` whose bytes are the pattern of `seed`.
pub fn host_pattern_i32(rows: u64, cols: u64, seed: u64) -> Result<Tensor> {
    let bytes = reference::pattern((rows * cols * 4) as usize, seed);
    Ok(Tensor::from_bytes(&bytes, DType::I32, &[rows, cols])?)
}

/// The strided views the route tests send, made by the same calls on any tensor of shape
/// `[256, 1024]` (transposes, narrows, slices with steps and offsets, a permute of a reshape):
/// `(name, view)`.
pub fn views_of(base: &Tensor) -> Result<Vec<(&'static str, Tensor)>> {
    Ok(vec![
        ("whole", base.clone()),
        ("transpose", base.transpose(0, 1)?),
        ("narrow", base.narrow(1, 100, 300)?),
        ("slice-step", base.slice(0, 3, 250, 7)?),
        ("slice-step-cols", base.slice(1, 5, 1000, 3)?),
        ("transpose-narrow-slice", base.transpose(0, 1)?.narrow(0, 17, 500)?.slice(1, 1, 255, 2)?),
        ("select-row", base.select(0, 131)?),
        ("permute-3d", base.reshape(&[16, 16, 1024])?.permute(&[2, 0, 1])?.narrow(0, 8, 64)?),
    ])
}

/// The CPU reference checksum of each view of [`views_of`] of the `i32` pattern of `seed`.
pub fn views_reference(seed: u64) -> Result<Vec<u64>> {
    let host = host_pattern_i32(256, 1024, seed)?;
    views_of(&host)?.into_iter().map(|(_, view)| Ok(reference::checksum(&view.to_bytes()?))).collect()
}

/// Waits up to `timeout` for `done`, polling every millisecond.
pub fn poll_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if done() {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The seed scenario's matrices (`n x n` f32): `x0[i][j] = (7i + j) mod 13`, the shift matrix
/// `a` (`a * x` moves every row up by one), and the expected `a^steps * x0`.
pub mod seed {
    /// `x0`.
    pub fn initial(n: u64) -> Vec<f32> {
        (0..n * n).map(|k| ((k / n * 7 + k % n) % 13) as f32).collect()
    }

    /// `a[i][j] = 1` where `j = i + 1 (mod n)`.
    pub fn shift_matrix(n: u64) -> Vec<f32> {
        (0..n * n).map(|k| if k % n == (k / n + 1) % n { 1.0 } else { 0.0 }).collect()
    }

    /// `a^steps * x0`: row `i` is row `(i + steps) mod n` of `x0`.
    pub fn expected(n: u64, steps: u64) -> Vec<f32> {
        let x0 = initial(n);
        (0..n * n).map(|k| x0[(((k / n + steps) % n) * n + k % n) as usize]).collect()
    }
}
