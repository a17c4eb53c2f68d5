//! The tensor API on host tensors, as a user outside the workspace calls it (runs in CI): the
//! same calls as on the GPU, and a pipeline stage that forwards what it received.

use std::time::Duration;

use integration_tests::socket_path;
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

#[test]
fn host_tensors_read_back_in_row_major_order_whatever_their_layout() {
    let t = Tensor::from_slice(&(0..6).collect::<Vec<i64>>(), DType::I64, &[2, 3]).unwrap();
    assert_eq!(t.to_vec::<i64>().unwrap(), [0, 1, 2, 3, 4, 5]);
    assert_eq!(t.transpose(0, 1).unwrap().to_vec::<i64>().unwrap(), [0, 3, 1, 4, 2, 5]);
    assert!(t.to_vec::<f64>().is_err(), "the element type must match");
    let strided = t.transpose(0, 1).unwrap();
    let packed = strided.contiguous().unwrap();
    assert!(packed.is_contiguous() && packed.to_vec::<i64>().unwrap() == [0, 3, 1, 4, 2, 5]);
    let target = Tensor::zeros(DType::I64, &[2, 3]).unwrap();
    target.transpose(0, 1).unwrap().fill(7i64).unwrap();
    assert_eq!(target.to_vec::<i64>().unwrap(), [7; 6], "a strided fill");
    strided.copy_into(&target.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(target.to_vec::<i64>().unwrap(), [0, 1, 2, 3, 4, 5], "copied through two strided views");
    assert!(t.copy_into(&Tensor::zeros(DType::I64, &[6]).unwrap()).is_err(), "shapes must match");
}

#[test]
fn a_stage_copies_what_it_received_and_sends_it_on() {
    let (first, second) = (socket_path("api-first"), socket_path("api-second"));
    let mut stage = Receiver::<Tensor>::bind(&first).unwrap();
    let mut last = Receiver::<Tensor>::bind(&second).unwrap();
    let to_stage = Sender::<Tensor>::connect(&first).unwrap();
    let onward = Sender::<Tensor>::connect(&second).unwrap();
    let original = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], DType::F32, &[2, 3]).unwrap();
    to_stage.send(&original.transpose(0, 1).unwrap()).unwrap();
    let received = stage.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(matches!(onward.send(&received), Err(Error::NotSendable(_))), "a received tensor is the sender's");
    let copy = received.copy().unwrap();
    assert!(copy.is_contiguous());
    onward.send(&copy).unwrap();
    drop(received);
    assert!(to_stage.wait_released(Duration::from_secs(10)), "the original comes back once the stage drops it");
    let arrived = last.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(arrived.to_vec::<f32>().unwrap(), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
}
