//! Errors a caller can act on are variants with their numbers, not strings (issue 23), as a user
//! outside the workspace matches them (runs in CI, no GPU needed): each test makes the mistake,
//! matches the variant, and where there is one, takes the way out the variant points to.

use std::process::Command;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use integration_tests::socket_path;
use tensor_queue::channel::Select;
use tensor_queue::route::{Landing, MAX_SOURCES, Routing};
use tensor_queue::{DType, Error, ParentProblem, Receiver, Sender, Tensor, TensorProblem, ViewProblem};

#[test]
fn a_tensor_given_the_wrong_data_says_how_much_was_given_and_needed() {
    let error = Tensor::from_bytes(&[0u8; 10], DType::F32, &[2, 2]).unwrap_err();
    assert!(
        matches!(error, Error::Tensor(TensorProblem::LengthMismatch { data_bytes: 10, tensor_bytes: 16 })),
        "{error:?}"
    );
    assert_eq!(error.to_string(), "10 bytes of data for 16 bytes of tensor");
    let t = Tensor::from_slice(&[1i32, 2, 3, 4], DType::I32, &[2, 2]).unwrap();
    match t.to_vec::<f32>() {
        Err(Error::Tensor(TensorProblem::DTypeMismatch { dtype, element })) => {
            assert_eq!((dtype.as_str(), element), ("I32", "f32"));
        }
        other => panic!("expected a dtype mismatch, got {other:?}"),
    }
    match t.get::<i32>(&[2, 0]) {
        Err(Error::Tensor(TensorProblem::BadIndex { index, shape })) => {
            assert_eq!((index, shape), (vec![2, 0], vec![2, 2]))
        }
        other => panic!("expected a bad index, got {other:?}"),
    }
    assert!(matches!(t.get::<i32>(&[0]), Err(Error::Tensor(TensorProblem::BadIndex { .. }))), "too few indices");
    let error = t.copy_into(&Tensor::zeros(DType::I32, &[4]).unwrap()).unwrap_err();
    match &error {
        Error::Tensor(TensorProblem::CopyMismatch { src_shape, dst_shape, .. }) => {
            assert_eq!((src_shape.as_slice(), dst_shape.as_slice()), (&[2u64, 2][..], &[4u64][..]));
        }
        other => panic!("expected a copy mismatch, got {other:?}"),
    }
    assert!(matches!(t.cuda_view(), Err(Error::Tensor(TensorProblem::NotCuda))), "a host tensor has no GPU view");
    let error = Tensor::zeros(DType::U8, &[1; 64]).unwrap_err();
    assert!(matches!(error, Error::Tensor(TensorProblem::TooManyDims { ndim: 64, .. })), "{error:?}");
}

#[test]
fn a_strided_tensor_is_not_contiguous_until_copied() {
    let t = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], DType::I32, &[2, 3]).unwrap();
    let strided = t.transpose(0, 1).unwrap();
    assert!(matches!(
        strided.host_elements::<i32>(),
        Err(Error::Tensor(TensorProblem::NotContiguous { call: "host_elements" }))
    ));
    let error = strided.reshape(&[6]).unwrap_err();
    assert!(matches!(error, Error::View { problem: ViewProblem::NotContiguous, .. }), "{error:?}");
    // What the variant says to do: copy it contiguous, then reshape.
    let packed = strided.contiguous().unwrap().reshape(&[6]).unwrap();
    assert_eq!(packed.to_vec::<i32>().unwrap(), [1, 4, 2, 5, 3, 6]);
}

#[test]
fn a_view_that_cannot_be_made_names_the_call_and_the_numbers() {
    let t = Tensor::zeros(DType::F32, &[2, 3]).unwrap();
    let error = t.narrow(1, 2, 2).unwrap_err();
    match &error {
        Error::View { call, shape, problem: ViewProblem::OutOfRange { dim: 1, size: 3 } } => {
            assert_eq!((call.as_str(), shape.as_slice()), ("narrow(1, 2, 2)", &[2u64, 3][..]));
        }
        other => panic!("expected an out-of-range view, got {other:?}"),
    }
    assert_eq!(error.to_string(), "narrow(1, 2, 2) of a [2, 3] tensor: dimension 1 has 3 entries");
    let checks = [
        (t.transpose(0, 2), ViewProblem::NoSuchDim { dim: 2, ndim: 2 }),
        (t.permute(&[0, 0]), ViewProblem::DimTwice { dim: 0 }),
        (t.permute(&[0]), ViewProblem::NotAPermutation { ndim: 2 }),
        (t.slice(0, 0, 2, 0), ViewProblem::ZeroStep),
        (t.slice(1, 3, 1, 1), ViewProblem::StartPastEnd { start: 3, end: 1, dim: 1 }),
        (t.expand(&[3]), ViewProblem::DropsDims),
        (t.expand(&[2, 4]), ViewProblem::NotBroadcastable { dim: 1, size: 3, target: 4 }),
        (t.reshape(&[5]), ViewProblem::CountMismatch { numel: 6 }),
        (t.select(0, 2), ViewProblem::OutOfRange { dim: 0, size: 2 }),
    ];
    for (result, expected) in checks {
        match result {
            Err(Error::View { problem, .. }) => assert_eq!(problem, expected),
            other => panic!("expected {expected:?}, got {other:?}"),
        }
    }
    let block = Tensor::zeros(DType::U8, &[16]).unwrap();
    assert!(
        matches!(block.as_layout(DType::F32, &[1], &[1], 2), Err(Error::View { problem: ViewProblem::Layout(_), .. })),
        "unaligned"
    );
}

#[test]
fn a_select_with_nothing_to_wait_for_is_typed_and_a_timeout_of_duration_max_waits_without_end() {
    assert!(matches!(Select::new().try_ready(), Err(Error::NothingToSelect)));
    let path = socket_path("errors-timeout");
    let mut receiver = Receiver::<u32>::bind(&path).unwrap();
    let sender = Sender::<u32>::connect(&path).unwrap();
    // A caller's "forever" is often `Duration::MAX`: a wait without end, never a panic or an error.
    sender.send_timeout(&7, Duration::MAX).unwrap();
    sender.wait_ready(Duration::MAX).unwrap();
    let mut select = Select::new();
    select.add(&receiver).unwrap();
    assert_eq!(select.ready_timeout(Duration::MAX).unwrap(), 0);
    assert_eq!(receiver.recv_timeout(Duration::MAX).unwrap(), 7);
    assert!(sender.wait_released(Duration::MAX));
}

#[test]
fn a_receiver_refuses_more_per_source_landings_than_it_keeps() {
    let mut routing = Routing::default();
    for n in 0..=MAX_SOURCES {
        routing = routing.land_from(ipc_core::Uuid([n as u8; 16]), Landing::Host);
    }
    let error = Receiver::<u32>::builder().routing(routing).bind(socket_path("errors-sources")).map(drop).unwrap_err();
    assert!(
        matches!(error, Error::TooManySources { count, max } if count == MAX_SOURCES + 1 && max == MAX_SOURCES),
        "{error:?}"
    );
}

#[test]
fn the_async_api_outside_a_runtime_says_so() {
    let path = socket_path("errors-async");
    let mut receiver = Receiver::<u32>::bind(&path).unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    assert!(matches!(receiver.poll_recv(&mut cx), Poll::Ready(Err(Error::NoRuntime))));
}

#[test]
fn a_process_not_started_by_spawn_has_no_parent_channel() {
    // The test harness did not start this process with `tensor_queue::spawn`.
    match tensor_queue::from_parent::<u32>() {
        Err(Error::NoParentChannel(ParentProblem::NotSpawned { variable })) => {
            assert_eq!(variable, "TENSOR_QUEUE_ENDPOINT");
        }
        other => panic!("expected NotSpawned, got {:?}", other.map(drop)),
    }
}

#[test]
fn a_child_that_cannot_start_is_typed_with_the_system_s_reason() {
    let missing = "/nonexistent/tensor-queue-no-such-program";
    match tensor_queue::spawn::<u32>(&mut Command::new(missing)) {
        Err(Error::ChildNotStarted { program, source }) => {
            assert_eq!(program, missing);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected ChildNotStarted, got {:?}", other.map(drop)),
    }
}
