//! `tq doctor --measure`'s small-message section: the threshold below which a message's GPU
//! tensors should travel inline over TCP rather than through NCCL on this machine
//! (`tensor_queue::route::inlines`, `SenderBuilder::inline_gpu_up_to`).
//!
//! Inline, a message pays a device-to-host copy into pinned memory at the sender (waited for),
//! its bytes through a TCP socket, and a host-to-device copy from pinned memory at the receiver,
//! as the channels make them: each is timed here at sizes from 4 KiB to 4 MiB, on GPU 0 and a
//! loopback TCP stream. Through NCCL it pays a fixed cost per
//! message (a send/receive pair of two processes, about 75 us a side) and its bytes on the
//! network, which the inline path pays too. A 2-rank communicator needs two processes, which the
//! doctor does not start: NCCL's cost is the documented estimate ([`NCCL_ESTIMATE_US`]), and the
//! report says so. The suggestion is where the inline cost crosses that estimate.

use std::io::{Read as _, Write as _};
use std::time::Instant;

use ipc_core::{Context, DeviceBuffer, PinnedHostBuffer, Stream};
use serde::Serialize;
use tensor_queue::route::{DEFAULT_INLINE_GPU_UP_TO, INLINE_GPU_ENV};

use crate::text::{paragraph, table};

/// The sizes timed.
const SIZES: [usize; 6] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
/// Timed repetitions per size (the median is kept), after one that warms up.
const REPEATS: usize = 25;
/// What an NCCL send/receive pair costs a message, both sides (about 75 us a side on the
/// machines measured: BENCHMARKS.md, "Across hosts").
pub const NCCL_ESTIMATE_US: f64 = 150.0;

/// One size's measured costs, in microseconds (medians).
#[derive(Clone, Debug, Serialize)]
pub struct InlineSize {
    /// The message's GPU bytes.
    pub bytes: usize,
    /// The sender's copy to the host (into pinned memory, waited for).
    pub d2h_us: f64,
    /// The bytes through a loopback TCP stream.
    pub tcp_us: f64,
    /// The receiver's copy to the GPU (from pinned memory, waited for).
    pub h2d_us: f64,
    /// All three: what the message pays inline.
    pub inline_us: f64,
}

/// The section: measured or why not, and the suggested threshold.
#[derive(Clone, Debug, Serialize)]
pub struct InlineReport {
    /// Whether the copies were timed.
    pub measured: bool,
    /// Why not, or what the figures rest on.
    pub note: String,
    /// Per size.
    pub sizes: Vec<InlineSize>,
    /// NCCL's cost per message used (us), and whether it was measured here (never, for now).
    pub nccl_us: f64,
    /// Whether `nccl_us` was measured here.
    pub nccl_measured: bool,
    /// The threshold this machine suggests, in bytes (where measured).
    pub suggested_up_to: Option<u64>,
    /// The library's default.
    pub default_up_to: u64,
    /// The environment variable that sets it for a process.
    pub env: &'static str,
}

impl InlineReport {
    /// Nothing measured, and why.
    pub fn not_measured(why: &str) -> InlineReport {
        InlineReport {
            measured: false,
            note: why.to_string(),
            sizes: Vec::new(),
            nccl_us: NCCL_ESTIMATE_US,
            nccl_measured: false,
            suggested_up_to: None,
            default_up_to: DEFAULT_INLINE_GPU_UP_TO,
            env: INLINE_GPU_ENV,
        }
    }

    /// The section as text.
    pub fn to_text(&self, width: usize) -> String {
        let mut out = String::from("\nSmall messages across hosts\n");
        out += &paragraph("  ", "a message's GPU tensors inline over TCP, or through NCCL:", 2, width);
        if !self.measured {
            let text = format!(
                "{}; the default threshold applies: {} bytes ({}=N sets another).",
                self.note, self.default_up_to, self.env
            );
            return out + &paragraph("  ", &text, 2, width);
        }
        let rows = self.sizes.iter().map(|s| {
            vec![
                bytes(s.bytes),
                format!("{:.1}", s.d2h_us),
                format!("{:.1}", s.tcp_us),
                format!("{:.1}", s.h2d_us),
                format!("{:.1}", s.inline_us),
                if s.inline_us <= self.nccl_us { "inline" } else { "NCCL" }.to_string(),
            ]
        });
        out += &table(&["size", "D2H us", "TCP us", "H2D us", "inline us", "cheaper"], rows, width);
        out += &paragraph("  ", &self.note, 2, width);
        let suggestion = match self.suggested_up_to {
            Some(up_to) => format!(
                "suggested threshold: {up_to} bytes ({}={up_to}, or SenderBuilder::inline_gpu_up_to); the default is {}.",
                self.env, self.default_up_to
            ),
            None => "no size measured is cheaper inline: 0 (always NCCL) suits this machine.".to_string(),
        };
        out + &paragraph("  ", &suggestion, 2, width)
    }
}

/// Times the inline path on GPU 0 (see the module docs).
pub fn measure() -> InlineReport {
    match measure_sizes() {
        Ok(sizes) => {
            let nccl_us = NCCL_ESTIMATE_US;
            let note = format!(
                "NCCL not measured (a 2-rank communicator needs two processes): its cost is the documented \
                 estimate of {nccl_us:.0} us a message (about 75 us a side); the bytes' network time is paid \
                 either way and left out."
            );
            let suggested_up_to = Some(crossover(&sizes, nccl_us));
            InlineReport { measured: true, note, sizes, suggested_up_to, ..InlineReport::not_measured("") }
        }
        Err(error) => InlineReport::not_measured(&format!("the copies could not be timed ({error})")),
    }
}

/// The largest size whose inline cost is at most `nccl_us`, interpolated between the sizes timed
/// (rounded down to 4 KiB); 0 when even the smallest costs more.
pub fn crossover(sizes: &[InlineSize], nccl_us: f64) -> u64 {
    let Some(first) = sizes.first().filter(|first| first.inline_us <= nccl_us) else { return 0 };
    let mut best = first.bytes as u64;
    for pair in sizes.windows(2) {
        let (low, high) = (&pair[0], &pair[1]);
        if high.inline_us > nccl_us {
            let share = (nccl_us - low.inline_us) / (high.inline_us - low.inline_us).max(f64::EPSILON);
            let at = low.bytes as f64 + share * (high.bytes - low.bytes) as f64;
            return (at as u64) / 4096 * 4096;
        }
        best = high.bytes as u64;
    }
    best
}

/// Any failure while timing, said as is.
type Failure = Box<dyn std::error::Error + Send + Sync>;

fn measure_sizes() -> Result<Vec<InlineSize>, Failure> {
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    let largest = SIZES[SIZES.len() - 1];
    let device = DeviceBuffer::alloc(&context, largest)?;
    let (staging, landing) = (PinnedHostBuffer::alloc(&context, largest)?, PinnedHostBuffer::alloc(&context, largest)?);
    let (mut writer, mut reader) = loopback()?;
    let mut out = Vec::new();
    for bytes in SIZES {
        let (mut d2h, mut tcp, mut h2d) = (Vec::new(), Vec::new(), Vec::new());
        let staged = vec![0u8; bytes];
        let mut landed = vec![0u8; bytes];
        for round in 0..=REPEATS {
            let start = Instant::now();
            stream.copy_async(&staging, 0, &device, 0, bytes)?;
            stream.synchronize()?;
            let d2h_us = start.elapsed().as_secs_f64() * 1e6;
            let start = Instant::now();
            std::thread::scope(|scope| {
                let sending = scope.spawn(|| writer.write_all(&staged));
                let read = reader.read_exact(&mut landed);
                sending.join().map_err(|_| Failure::from("the writing thread panicked"))??;
                Ok::<_, Failure>(read?)
            })?;
            let tcp_us = start.elapsed().as_secs_f64() * 1e6;
            let start = Instant::now();
            stream.copy_async(&device, 0, &landing, 0, bytes)?;
            stream.synchronize()?;
            let h2d_us = start.elapsed().as_secs_f64() * 1e6;
            if round > 0 {
                d2h.push(d2h_us);
                tcp.push(tcp_us);
                h2d.push(h2d_us);
            }
        }
        let (d2h_us, tcp_us, h2d_us) = (median(d2h), median(tcp), median(h2d));
        out.push(InlineSize { bytes, d2h_us, tcp_us, h2d_us, inline_us: d2h_us + tcp_us + h2d_us });
    }
    Ok(out)
}

/// A connected loopback TCP pair: (writer, reader).
fn loopback() -> std::io::Result<(std::net::TcpStream, std::net::TcpStream)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let writer = std::net::TcpStream::connect(listener.local_addr()?)?;
    let (reader, _) = listener.accept()?;
    writer.set_nodelay(true)?;
    Ok((writer, reader))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn bytes(n: usize) -> String {
    if n >= 1 << 20 { format!("{} MiB", n >> 20) } else { format!("{} KiB", n >> 10) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(bytes: usize, inline_us: f64) -> InlineSize {
        InlineSize { bytes, d2h_us: 0.0, tcp_us: 0.0, h2d_us: 0.0, inline_us }
    }

    #[test]
    fn the_crossover_is_interpolated_between_the_sizes_timed() {
        let sizes = [size(4096, 30.0), size(16384, 50.0), size(65536, 100.0), size(262144, 250.0)];
        // 150 us lies a third of the way from 64 KiB (100) to 256 KiB (250).
        assert_eq!(crossover(&sizes, 150.0), 131072);
        assert_eq!(crossover(&sizes, 1000.0), 262144, "every size is cheaper inline");
        assert_eq!(crossover(&sizes, 20.0), 0, "none is");
        assert_eq!(crossover(&sizes, 50.0), 16384);
        assert_eq!(crossover(&[size(4096, 10.0)], 150.0), 4096);
        assert_eq!(crossover(&[], 150.0), 0);
    }

    #[test]
    fn unmeasured_says_why_and_the_default() {
        let report = InlineReport::not_measured("no GPU here");
        let text = report.to_text(100);
        assert!(text.contains("no GPU here") && text.contains(&DEFAULT_INLINE_GPU_UP_TO.to_string()), "{text}");
        assert!(text.contains(INLINE_GPU_ENV), "{text}");
    }
}
