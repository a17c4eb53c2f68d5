//! Every ordered pair of GPUs: the link, and the route tensor-queue takes between them, decided
//! by `tensor_queue::route::choose` itself (the doctor has no policy of its own), with an
//! optional measured bandwidth.

use std::time::Instant;

use serde::Serialize;
use tensor_queue::route::{Landing, PeerMode, Route, Routing};
use tensor_queue::testing::{Reach, choose, staging_piece};
use tensor_queue::{Context, Stream, Uuid};

use crate::text::{paragraph, table};
use crate::verdict::Verdict;

/// The small and the large tensor the route rows describe (and the sizes `--measure` adds 1 MiB to).
pub const SMALL: usize = 4 << 10;
/// See [`SMALL`].
pub const LARGE: usize = 64 << 20;
/// The copy sizes `--measure` times.
pub const MEASURED_SIZES: [usize; 3] = [SMALL, 1 << 20, LARGE];
/// Below this share of the expected bandwidth (at [`LARGE`]) a pair is slower than possible.
pub const FLAG_BELOW: f64 = 0.85;

/// What the driver and NVML say a link is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    /// NVLink (`nvidia-smi topo -m` shows `NV#`).
    Nvlink,
    /// PCIe or through the host.
    Pcie,
    /// NVML is missing, so the kind is not known.
    Unknown,
}

impl LinkKind {
    fn of(nvlink: Option<bool>) -> LinkKind {
        match nvlink {
            Some(true) => LinkKind::Nvlink,
            Some(false) => LinkKind::Pcie,
            None => LinkKind::Unknown,
        }
    }

    fn label(self) -> &'static str {
        match self {
            LinkKind::Nvlink => "NVLink",
            LinkKind::Pcie => "PCIe",
            LinkKind::Unknown => "unknown",
        }
    }

    /// What a 64 MiB copy over a link of this kind should reach, in GB/s: an estimate from the
    /// link kind alone (NVLink 4 on an H200, about 390 GB/s; PCIe Gen5 x16, about 50 GB/s;
    /// an unknown link is assumed to be PCIe), not a measurement of this machine.
    pub fn expected_gb_per_s(self) -> f64 {
        match self {
            LinkKind::Nvlink => 390.0,
            LinkKind::Pcie | LinkKind::Unknown => 50.0,
        }
    }
}

/// One receiver policy and the route `choose` gives for it.
#[derive(Clone, Debug, Serialize)]
pub struct RouteRow {
    /// The policy: `default` (`Routing::default()`), `device_copy`
    /// (`Landing::Device(target)`, `PeerMode::Copy`) or `device_map` (the same with `PeerMode::Map`).
    pub routing: &'static str,
    /// The route (`same_device`, `peer_map`, `peer_copy`, `staged`, `host`), or `None` if refused.
    pub route: Option<String>,
    /// The route in words.
    pub description: String,
    /// Where the tensor is used from (the target GPU's UUID; `None`: host memory).
    pub target: Option<String>,
    /// `choose`'s reason when the route is slower than the link allows.
    pub slower_because: Option<String>,
    /// How a 4 KiB tensor moves on this route.
    pub small: String,
    /// How a 64 MiB tensor moves on this route.
    pub large: String,
}

/// A measured copy between the pair.
#[derive(Clone, Debug, Serialize)]
pub struct Bandwidth {
    /// The copy's size.
    pub bytes: usize,
    /// Measured, in GB/s (10^9 bytes a second).
    pub gb_per_s: f64,
    /// What the link should give (an estimate by link kind, at 64 MiB with peer access only).
    pub expected_gb_per_s: Option<f64>,
    /// Whether the measurement is under 85 % of the expected figure.
    pub flagged: bool,
}

/// One ordered pair: tensors on `source` received for `target`.
#[derive(Clone, Debug, Serialize)]
pub struct PairRow {
    /// The source GPU's ordinal in this process.
    pub source: usize,
    /// The target GPU's ordinal in this process.
    pub target: usize,
    /// The source GPU's UUID.
    pub source_uuid: String,
    /// The target GPU's UUID.
    pub target_uuid: String,
    /// The link between them.
    pub link: LinkKind,
    /// Whether the source GPU can access the target's memory (`cuDeviceCanAccessPeer`).
    pub peer_access: bool,
    /// The driver's performance rank of the link.
    pub rank: i32,
    /// Whether atomics over the link are native.
    pub native_atomics: bool,
    /// The route under each receiver policy.
    pub routes: Vec<RouteRow>,
    /// Measured copies (`--measure` only).
    pub bandwidth: Vec<Bandwidth>,
    /// How the pair stands.
    pub verdict: Verdict,
    /// What to do about it.
    pub fix: Option<String>,
}

const NO_P2P_FIX: &str = "these GPUs have no peer access, so tensors between them are staged through host memory: \
                          pair processes on GPUs that share NVLink or a PCIe switch (see `nvidia-smi topo -m`), \
                          or enable P2P (IOMMU/ACS settings, a VM's GPU passthrough)";

/// The rows for every ordered pair of GPUs in `reach`, with `reach` used as both the sender's
/// and the receiver's (one process seeing these GPUs on each side). A fake `Reach` gives the
/// rows of a made-up machine.
pub fn pair_rows(reach: &Reach) -> Vec<PairRow> {
    let mut rows = Vec::new();
    for (source, a) in reach.devices.iter().enumerate() {
        for (target, b) in reach.devices.iter().enumerate().filter(|(target, _)| *target != source) {
            rows.push(pair_row(reach, (source, a.uuid), (target, b.uuid)));
        }
    }
    rows
}

fn pair_row(reach: &Reach, (source, a): (usize, Uuid), (target, b): (usize, Uuid)) -> PairRow {
    let link = reach.link(&a, &b);
    let policies = [
        ("default", Routing::default()),
        ("device_copy", Routing::default().land(Landing::Device(b)).peer(PeerMode::Copy)),
        ("device_map", Routing::default().land(Landing::Device(b)).peer(PeerMode::Map)),
    ];
    let routes: Vec<RouteRow> = policies.iter().map(|(name, routing)| route_row(name, &a, routing, reach)).collect();
    let peer_access = link.is_some_and(|l| l.peer_access);
    let mut verdict = Verdict::Ok;
    let mut fix = None;
    if routes.iter().any(|r| r.route.is_none()) {
        verdict = Verdict::Broken;
        fix = Some("the default policy refused a route: report this as a tensor-queue bug".to_string());
    } else if let Some(why) = routes.iter().find_map(|r| r.slower_because.as_deref()) {
        verdict = Verdict::SlowerThanPossible;
        fix = Some(if peer_access { why.to_string() } else { NO_P2P_FIX.to_string() });
    }
    PairRow {
        source,
        target,
        source_uuid: a.to_string(),
        target_uuid: b.to_string(),
        link: LinkKind::of(link.and_then(|l| l.nvlink)),
        peer_access,
        rank: link.map_or(0, |l| l.rank),
        native_atomics: link.is_some_and(|l| l.native_atomics),
        routes,
        bandwidth: Vec::new(),
        verdict,
        fix,
    }
}

fn route_row(name: &'static str, source: &Uuid, routing: &Routing, reach: &Reach) -> RouteRow {
    match choose(source, routing, reach, reach) {
        Ok(choice) => RouteRow {
            routing: name,
            route: Some(route_code(choice.route).to_string()),
            description: choice.route.to_string(),
            target: choice.target.map(|t| t.to_string()),
            slower_because: choice.slower_because,
            small: movement(choice.route, SMALL),
            large: movement(choice.route, LARGE),
        },
        Err(forbidden) => RouteRow {
            routing: name,
            route: None,
            description: forbidden.to_string(),
            target: None,
            slower_because: Some(forbidden.why),
            small: String::new(),
            large: String::new(),
        },
    }
}

/// The route's name in the JSON.
fn route_code(route: Route) -> &'static str {
    match route {
        Route::SameDevice => "same_device",
        Route::PeerMap => "peer_map",
        Route::PeerCopy => "peer_copy",
        Route::Staged => "staged",
        Route::Host => "host",
        _ => "other",
    }
}

/// The route's name in the table.
fn route_short(route: Option<&str>) -> &'static str {
    match route {
        Some("same_device") => "same GPU",
        Some("peer_map") => "peer map",
        Some("peer_copy") => "peer copy",
        Some("staged") => "staged",
        Some("host") => "host",
        Some(_) => "other",
        None => "REFUSED",
    }
}

/// How a tensor of `len` bytes moves on `route` (`choose` picks the route whatever the size;
/// the size changes how the staged route cuts it).
fn movement(route: Route, len: usize) -> String {
    match route {
        Route::SameDevice | Route::PeerMap => "mapped in place, no copy".into(),
        Route::PeerCopy => "one copy-engine copy over the link".into(),
        Route::Staged => {
            let piece = staging_piece(len).min(len);
            let pieces = len.div_ceil(piece);
            format!("{pieces} piece(s) of {} through pinned host memory, pipelined", human_bytes(piece))
        }
        Route::Host => "one copy into shared host memory".into(),
        _ => "unknown".into(),
    }
}

fn human_bytes(bytes: usize) -> String {
    if bytes >= 1 << 20 { format!("{} MiB", bytes >> 20) } else { format!("{} KiB", bytes >> 10) }
}

/// The pairs as a table: one line a pair, the route under each policy, and the verdict.
pub fn pairs_table(rows: &[PairRow], width: usize) -> String {
    let measured = rows.iter().any(|r| !r.bandwidth.is_empty());
    let mut headers = vec!["pair", "link", "p2p", "rank", "atomics", "default", "on target: copy", "on target: map"];
    if measured {
        headers.extend(["4K / 1M / 64M GB/s (expected*)"]);
    }
    headers.push("verdict");
    let lines = rows.iter().map(|row| {
        let yes = |b: bool| if b { "yes" } else { "no" }.to_string();
        let mut cells = vec![
            format!("GPU{} -> GPU{}", row.source, row.target),
            row.link.label().to_string(),
            yes(row.peer_access),
            row.rank.to_string(),
            yes(row.native_atomics),
        ];
        cells.extend(row.routes.iter().map(|r| route_short(r.route.as_deref()).to_string()));
        if measured {
            let figures: Vec<String> = row.bandwidth.iter().map(|b| format!("{:.1}", b.gb_per_s)).collect();
            let expected = row.bandwidth.iter().find_map(|b| b.expected_gb_per_s);
            let expected = expected.map_or(String::new(), |e| format!(" ({e:.0}*)"));
            cells.push(format!("{}{expected}", figures.join(" / ")));
        }
        cells.push(row.verdict.label().to_string());
        cells
    });
    let mut out = table(&headers, lines, width);
    if rows.iter().any(|r| r.routes.iter().any(|route| route.route.as_deref() == Some("staged"))) {
        let note = "4 KiB moves as 1 piece, 64 MiB as 16 pieces of 4 MiB (route::staging_piece)";
        out += &paragraph("  staged: ", note, 4, width);
    }
    if measured {
        let note = "an estimate by link kind (NVLink on an H200 ~390 GB/s, PCIe Gen5 ~50 GB/s at 64 MiB), not a \
                    measurement; flagged under 85 %";
        out += &paragraph("  * expected: ", note, 4, width);
    }
    out
}

/// Times copies of [`MEASURED_SIZES`] from `source`'s memory into `target`'s (ordinals of this
/// process), on a stream of `source`, with peer access enabled where the pair has it.
pub fn measure_copy(source: usize, target: usize, peer_access: bool) -> ipc_core::Result<Vec<f64>> {
    let a = Context::on_ordinal(source as i32)?;
    let b = Context::on_ordinal(target as i32)?;
    if peer_access {
        a.enable_peer_access(&b)?;
        b.enable_peer_access(&a)?;
    }
    let stream = Stream::new(&a)?;
    let src = ipc_core::DeviceBuffer::alloc(&a, LARGE)?;
    let dst = ipc_core::DeviceBuffer::alloc(&b, LARGE)?;
    let mut figures = Vec::new();
    for len in MEASURED_SIZES {
        // Enough copies that the wall clock's overhead is small beside them.
        let repeats = if len >= LARGE { 20 } else { 200 };
        ipc_core::copy_peer_async(&dst, &src, len, &stream)?;
        stream.synchronize()?;
        let start = Instant::now();
        for _ in 0..repeats {
            ipc_core::copy_peer_async(&dst, &src, len, &stream)?;
        }
        stream.synchronize()?;
        figures.push((len * repeats) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    Ok(figures)
}

/// Puts measured figures (GB/s at each of [`MEASURED_SIZES`]) into `row` and flags a 64 MiB copy
/// under 85 % of what its link should give; a failed measurement makes the pair broken.
pub fn apply_measurement(row: &mut PairRow, measured: ipc_core::Result<Vec<f64>>) {
    let figures = match measured {
        Ok(figures) => figures,
        Err(error) => {
            row.verdict = Verdict::Broken;
            row.fix = Some(format!(
                "copying between the two GPUs failed ({error}): check `nvidia-smi` and dmesg for Xid errors"
            ));
            return;
        }
    };
    for (&bytes, gb_per_s) in MEASURED_SIZES.iter().zip(figures) {
        let expected = (bytes == LARGE && row.peer_access).then(|| row.link.expected_gb_per_s());
        let flagged = expected.is_some_and(|e| gb_per_s < FLAG_BELOW * e);
        if flagged && row.verdict == Verdict::Ok {
            row.verdict = Verdict::SlowerThanPossible;
            row.fix = Some(format!(
                "a 64 MiB copy measured {gb_per_s:.0} GB/s, under 85 % of the ~{:.0} GB/s a {} link should give \
                 (an estimate): check `nvidia-smi nvlink -s` or the PCIe link width (`nvidia-smi -q | grep -A2 'Link Width'`), \
                 and other traffic on the GPUs",
                row.link.expected_gb_per_s(),
                row.link.label()
            ));
        }
        row.bandwidth.push(Bandwidth { bytes, gb_per_s, expected_gb_per_s: expected, flagged });
    }
}

#[cfg(test)]
mod tests {
    use tensor_queue::testing::{DeviceReach, LinkReach};

    use super::*;
    use crate::text::DEFAULT_WIDTH;
    use crate::verdict::Summary;

    fn gpu(n: u8) -> Uuid {
        Uuid([n; 16])
    }

    /// A made-up machine: `gpus`, and for each ordered pair, `link(from, to)` = (peer access, NVLink).
    fn machine(gpus: &[u8], link: impl Fn(u8, u8) -> (bool, Option<bool>)) -> Reach {
        let devices = gpus.iter().map(|&n| DeviceReach { uuid: gpu(n), stream_ops: true }).collect();
        let mut links = Vec::new();
        for &from in gpus {
            for &to in gpus.iter().filter(|&&to| to != from) {
                let (peer_access, nvlink) = link(from, to);
                let rank = i32::from(peer_access && nvlink == Some(true));
                links.push(LinkReach {
                    from: gpu(from),
                    to: gpu(to),
                    peer_access,
                    nvlink,
                    rank,
                    native_atomics: peer_access,
                });
            }
        }
        Reach { devices, links }
    }

    fn routes(row: &PairRow) -> Vec<&str> {
        row.routes.iter().map(|r| r.route.as_deref().unwrap_or("refused")).collect()
    }

    fn strict_fails(rows: &[PairRow]) -> bool {
        Summary::of(rows.iter().map(|r| r.verdict), []).strict_fails
    }

    #[test]
    fn an_nvlink_pair_is_ok() {
        let rows = pair_rows(&machine(&[0, 1], |_, _| (true, Some(true))));
        assert_eq!(rows.len(), 2, "both directions");
        for row in &rows {
            assert_eq!(row.link, LinkKind::Nvlink);
            assert!(row.peer_access && row.native_atomics);
            assert_eq!(routes(row), ["same_device", "peer_copy", "peer_map"]);
            assert_eq!(row.verdict, Verdict::Ok, "{row:?}");
            assert!(row.fix.is_none());
            assert_eq!(row.routes[1].target.as_deref(), Some(row.target_uuid.as_str()));
        }
        assert!(!strict_fails(&rows));
        let json = serde_json::to_value(&rows[0]).unwrap();
        assert_eq!(json["link"], "nvlink");
        assert_eq!(json["routes"][1]["routing"], "device_copy");
    }

    #[test]
    fn a_pcie_pair_without_p2p_is_slower_and_fails_strict() {
        let rows = pair_rows(&machine(&[0, 1], |_, _| (false, Some(false))));
        for row in &rows {
            assert_eq!(row.link, LinkKind::Pcie);
            assert!(!row.peer_access && row.rank == 0 && !row.native_atomics);
            assert_eq!(routes(row), ["same_device", "staged", "staged"]);
            assert_eq!(row.verdict, Verdict::SlowerThanPossible);
            assert!(row.routes[1].slower_because.as_deref().unwrap().contains("no peer access"));
            assert!(row.fix.as_deref().unwrap().contains("nvidia-smi topo -m"), "{:?}", row.fix);
            assert!(row.routes[1].large.contains("16 piece(s) of 4 MiB"), "{}", row.routes[1].large);
            assert!(row.routes[1].small.starts_with("1 piece(s) of 4 KiB"), "{}", row.routes[1].small);
        }
        assert!(strict_fails(&rows));
        assert!(pairs_table(&rows, DEFAULT_WIDTH).contains("staged"));
    }

    #[test]
    fn three_gpus_two_on_nvlink_one_on_pcie() {
        // 0 and 1 share NVLink; 2 hangs off PCIe with P2P to 0 only, not to 1.
        let reach = machine(&[0, 1, 2], |from, to| match (from.min(to), from.max(to)) {
            (0, 1) => (true, Some(true)),
            (0, 2) => (true, Some(false)),
            _ => (false, Some(false)),
        });
        let rows = pair_rows(&reach);
        assert_eq!(rows.len(), 6);
        let row = |s, t| rows.iter().find(|r| r.source == s && r.target == t).unwrap();
        assert_eq!((row(0, 1).link, row(0, 1).verdict), (LinkKind::Nvlink, Verdict::Ok));
        assert_eq!((row(2, 0).link, row(2, 0).verdict), (LinkKind::Pcie, Verdict::Ok));
        assert_eq!(routes(row(2, 0)), ["same_device", "peer_copy", "peer_map"]);
        for (s, t) in [(1, 2), (2, 1)] {
            assert_eq!(row(s, t).verdict, Verdict::SlowerThanPossible);
            assert_eq!(routes(row(s, t)), ["same_device", "staged", "staged"]);
        }
        assert!(strict_fails(&rows));
        let text = pairs_table(&rows, 200);
        assert_eq!(text.lines().filter(|l| l.contains("slower than possible")).count(), 2, "{text}");
        let narrow = pairs_table(&rows, DEFAULT_WIDTH);
        assert!(narrow.lines().all(|l| l.chars().count() <= DEFAULT_WIDTH), "{narrow}");
        println!("{narrow}");
    }

    #[test]
    fn no_gpus_no_pairs() {
        assert!(pair_rows(&Reach::default()).is_empty());
        assert!(pair_rows(&machine(&[0], |_, _| (true, None))).is_empty());
    }

    #[test]
    fn a_slow_measurement_is_flagged_and_a_failed_one_is_broken() {
        let rows = pair_rows(&machine(&[0, 1], |_, _| (true, Some(true))));
        let mut slow = rows[0].clone();
        apply_measurement(&mut slow, Ok(vec![1.0, 50.0, 200.0]));
        assert_eq!(slow.verdict, Verdict::SlowerThanPossible);
        assert!(slow.bandwidth[2].flagged && !slow.bandwidth[0].flagged);
        assert_eq!(slow.bandwidth[2].expected_gb_per_s, Some(390.0));
        let mut fast = rows[0].clone();
        apply_measurement(&mut fast, Ok(vec![1.0, 50.0, 380.0]));
        assert_eq!(fast.verdict, Verdict::Ok);
        assert!(pairs_table(&[fast.clone()], 200).contains("380.0 (390*)"));
        let narrow = pairs_table(&[fast], DEFAULT_WIDTH);
        assert!(narrow.lines().all(|l| l.chars().count() <= DEFAULT_WIDTH), "{narrow}");
        println!("{narrow}");
        let mut failed = rows[0].clone();
        apply_measurement(&mut failed, Err(ipc_core::Error::InvalidArgument("test".into())));
        assert_eq!(failed.verdict, Verdict::Broken);
    }
}
