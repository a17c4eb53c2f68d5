//! Every kind of view of a host tensor, and compositions of them, crosses a channel intact: to a
//! receiver in this process (same shape, strides and row-major bytes) and to another process (the
//! same row-major bytes, by checksum). The expected bytes are worked out by hand from what each
//! element holds, not by reading the view, so a wrong view fails here even if both ends agree.

use std::time::Duration;

use integration_tests::queue::{Probe, Report, spawn_tq_peer};
use integration_tests::socket_path;
use kernels::reference;
use tensor_queue::{DType, Receiver, Sender, Tensor, TransferPath};

/// A view to send and the row-major bytes it must read as.
struct Case {
    name: &'static str,
    tensor: Tensor,
    expected: Vec<u8>,
}

/// Element `(i, j, k)` of [`base`]: its value names its index.
fn v(i: u64, j: u64, k: u64) -> i32 {
    (100 * i + 10 * j + k) as i32
}

/// A contiguous `[3, 4, 5]` i32 tensor holding `v(i, j, k)`.
fn base() -> Tensor {
    let data: Vec<i32> = (0..3).flat_map(|i| (0..4).flat_map(move |j| (0..5).map(move |k| v(i, j, k)))).collect();
    Tensor::from_slice(&data, DType::I32, &[3, 4, 5]).unwrap()
}

/// Little-endian bytes of i32 elements, in the order given.
fn ints(values: impl IntoIterator<Item = i32>) -> Vec<u8> {
    values.into_iter().flat_map(i32::to_le_bytes).collect()
}

/// The views to send, each with its bytes worked out by hand.
fn cases() -> Vec<Case> {
    let t = base();
    let scalar = t.select(0, 1).unwrap().select(0, 2).unwrap().select(0, 3).unwrap();
    // Other element sizes: one byte (odd offsets) and eight.
    let bytes = Tensor::from_slice(&(0..42u8).collect::<Vec<_>>(), DType::U8, &[6, 7]).unwrap();
    let doubles =
        Tensor::from_slice(&(0..12).map(|n| f64::from(n) + 0.5).collect::<Vec<_>>(), DType::F64, &[4, 3]).unwrap();
    let case = |name, tensor: Tensor, expected| Case { name, tensor, expected };
    vec![
        case(
            "contiguous",
            t.clone(),
            ints((0..3).flat_map(|i| (0..4).flat_map(move |j| (0..5).map(move |k| v(i, j, k))))),
        ),
        case(
            "transpose(0, 2)",
            t.transpose(0, 2).unwrap(),
            ints((0..5).flat_map(|k| (0..4).flat_map(move |j| (0..3).map(move |i| v(i, j, k))))),
        ),
        case(
            "permute([2, 0, 1])",
            t.permute(&[2, 0, 1]).unwrap(),
            ints((0..5).flat_map(|k| (0..3).flat_map(move |i| (0..4).map(move |j| v(i, j, k))))),
        ),
        case(
            "narrow(1, 1, 2)",
            t.narrow(1, 1, 2).unwrap(),
            ints((0..3).flat_map(|i| (1..3).flat_map(move |j| (0..5).map(move |k| v(i, j, k))))),
        ),
        case(
            "slice(2, 1, 5, 2)",
            t.slice(2, 1, 5, 2).unwrap(),
            ints((0..3).flat_map(|i| (0..4).flat_map(move |j| [1, 3].map(move |k| v(i, j, k))))),
        ),
        case(
            "slice(0, 0, MAX, 2), the end clamped",
            t.slice(0, 0, u64::MAX, 2).unwrap(),
            ints([0, 2].into_iter().flat_map(|i| (0..4).flat_map(move |j| (0..5).map(move |k| v(i, j, k))))),
        ),
        case("slice(1, 2, 2, 1), empty", t.slice(1, 2, 2, 1).unwrap(), Vec::new()),
        case(
            "flip([0, 2])",
            t.flip(&[0, 2]).unwrap(),
            ints((0..3).rev().flat_map(|i| (0..4).flat_map(move |j| (0..5).rev().map(move |k| v(i, j, k))))),
        ),
        case("select(1, 2)", t.select(1, 2).unwrap(), ints((0..3).flat_map(|i| (0..5).map(move |k| v(i, 2, k))))),
        case(
            "expand([2, 3, 4, 5]) of narrow(1, 3, 1)",
            t.narrow(1, 3, 1).unwrap().expand(&[2, 3, 4, 5]).unwrap(),
            ints((0..2).flat_map(|_| (0..3).flat_map(|i| (0..4).flat_map(move |_| (0..5).map(move |k| v(i, 3, k)))))),
        ),
        case(
            "flip([0]) of permute([2, 0, 1]) of slice(2, 0, 5, 2)",
            t.slice(2, 0, 5, 2).unwrap().permute(&[2, 0, 1]).unwrap().flip(&[0]).unwrap(),
            ints([4, 2, 0].into_iter().flat_map(|k| (0..3).flat_map(move |i| (0..4).map(move |j| v(i, j, k))))),
        ),
        case(
            "select(1, 0) of flip([1])",
            t.flip(&[1]).unwrap().select(1, 0).unwrap(),
            ints((0..3).flat_map(|i| (0..5).map(move |k| v(i, 3, k)))),
        ),
        case(
            "expand([3, 5]) of a flipped row",
            t.select(0, 2).unwrap().select(0, 1).unwrap().flip(&[0]).unwrap().expand(&[3, 5]).unwrap(),
            ints((0..3).flat_map(|_| (0..5).rev().map(|k| v(2, 1, k)))),
        ),
        case("a 0-d select", scalar.clone(), ints([v(1, 2, 3)])),
        case("expand([2, 3]) of a 0-d tensor", scalar.expand(&[2, 3]).unwrap(), ints([v(1, 2, 3); 6])),
        case(
            "reshape([8, 5]) of narrow(0, 1, 2)",
            t.narrow(0, 1, 2).unwrap().reshape(&[8, 5]).unwrap(),
            ints((1..3).flat_map(|i| (0..4).flat_map(move |j| (0..5).map(move |k| v(i, j, k))))),
        ),
        case(
            "flip([0]) of slice(1, 1, 7, 3) of u8",
            bytes.slice(1, 1, 7, 3).unwrap().flip(&[0]).unwrap(),
            (0..6u8).rev().flat_map(|r| [1, 4].map(|c| r * 7 + c)).collect(),
        ),
        case(
            "narrow(1, 1, 2) of transpose(0, 1) of f64",
            doubles.transpose(0, 1).unwrap().narrow(1, 1, 2).unwrap(),
            (0..3).flat_map(|c| (1..3).map(move |r| f64::from(r * 3 + c) + 0.5)).flat_map(f64::to_le_bytes).collect(),
        ),
    ]
}

#[test]
fn every_view_kind_reads_as_worked_out_by_hand() {
    for case in cases() {
        assert_eq!(case.tensor.to_bytes().unwrap(), case.expected, "{}", case.name);
    }
}

#[test]
fn every_view_kind_arrives_intact_in_this_process() {
    let path = socket_path("views");
    let mut receiver = Receiver::<Vec<Tensor>>::bind(&path).unwrap();
    let sender = Sender::<Vec<Tensor>>::connect(&path).unwrap();
    let cases = cases();
    sender.send(&cases.iter().map(|case| case.tensor.clone()).collect()).unwrap();
    let received = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(received.len(), cases.len());
    for (case, got) in cases.iter().zip(&received) {
        let name = case.name;
        assert_eq!((got.dtype(), got.shape()), (case.tensor.dtype(), case.tensor.shape()), "{name}");
        assert_eq!(got.strides(), case.tensor.strides(), "{name}: views arrive as views, not copies");
        assert_eq!(got.to_bytes().unwrap(), case.expected, "{name}");
        assert_eq!(got.path(), TransferPath::HostSharedMemory, "{name}");
    }
}

#[test]
fn every_view_kind_arrives_intact_in_another_process() {
    let (mut child, sender, mut reports) = spawn_tq_peer::<Probe, Report>("checksum", &[], &[]).unwrap();
    let cases = cases();
    let expected: Vec<u64> = cases.iter().map(|case| reference::checksum(&case.expected)).collect();
    let tensors = cases.iter().map(|case| case.tensor.clone()).collect();
    sender.send(&Probe { id: 1, tensors, expected: expected.clone(), note: "views".into() }).unwrap();
    let report = reports.recv_timeout(Duration::from_secs(60)).unwrap();
    assert_eq!((report.id, report.checksums.len()), (1, cases.len()));
    for ((case, seen), want) in cases.iter().zip(&report.checksums).zip(&expected) {
        assert_eq!(seen, want, "{}: the other process read other bytes", case.name);
    }
    assert!(report.paths.iter().all(|path| path == "HostSharedMemory"), "{:?}", report.paths);
    drop(sender);
    assert!(child.wait().unwrap().success());
}
