//! Sending never pays for NVML (tens of milliseconds to initialise): the route of a message needs
//! only the driver's answers, and NVML is for reports (`tq doctor`). One test in its own process,
//! so that nothing else in it loads NVML first: it sends host messages, asks a sender for a route
//! and, where there are GPUs, sends GPU tensors to the same GPU and across two, then reads the
//! loader's switch. Without a GPU the GPU half says it is skipped.

use std::time::Duration;

use tensor_queue::route::{Landing, Routing};
use tensor_queue::testing::Reach;
use tensor_queue::{Context, DType, Device, Receiver, Sender, Stream, Tensor, Uuid};

const TIMEOUT: Duration = Duration::from_secs(20);

#[test]
fn the_send_path_never_loads_nvml() {
    assert!(!cuda_sys::nvml::load_attempted(), "nothing has run yet");
    let path = integration_tests::socket_path("no-nvml-host");
    let mut receiver = Receiver::<Tensor>::bind(&path).unwrap();
    let sender = Sender::<Tensor>::connect(&path).unwrap();
    for i in 0..3u8 {
        sender.send(&Tensor::from_slice(&[i; 64], DType::U8, &[64]).unwrap()).unwrap();
        assert_eq!(receiver.recv_timeout(TIMEOUT).unwrap().to_vec::<u8>().unwrap(), vec![i; 64]);
    }
    // The route report asks for this process's GPUs as a send does.
    let _ = sender.route(&Uuid([7; 16]), TIMEOUT).unwrap();
    let reach = Reach::local();
    assert!(reach.links.iter().all(|link| link.nvlink.is_none()), "the route's reach asks no NVML");
    let gpus = if cuda_sys::is_available() { Device::count().unwrap_or(0) } else { 0 };
    if gpus == 0 {
        println!("GPU half skipped: no CUDA driver or no GPU here");
    } else {
        send_gpu_tensor(0, None);
        if gpus >= 2 {
            let target = Device::get(1).unwrap().uuid().unwrap();
            send_gpu_tensor(0, Some(target));
        } else {
            println!("cross-GPU half skipped: one GPU here");
        }
    }
    assert!(!cuda_sys::nvml::load_attempted(), "a send, a receive or a route report loaded NVML");
    // The switch works: the reports' reach does load it (or tries to, where it is missing).
    let _ = Reach::local_with_interconnect();
    assert_eq!(cuda_sys::nvml::load_attempted(), gpus > 0, "the report's reach asks NVML where there are GPUs");
}

/// One GPU tensor from the GPU `ordinal` to a receiver in this process that lands it on `target`
/// (as sent when `None`), read back.
fn send_gpu_tensor(ordinal: i32, target: Option<Uuid>) {
    let context = Context::on_ordinal(ordinal).unwrap();
    let stream = Stream::new(&context).unwrap();
    let path = integration_tests::socket_path("no-nvml-gpu");
    let mut routing = Routing::default();
    if let Some(target) = target {
        routing = routing.land(Landing::Device(target));
    }
    let mut receiver = Receiver::<Tensor>::builder().routing(routing).bind(&path).unwrap();
    let sender = Sender::<Tensor>::connect(&path).unwrap();
    let data: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    let tensor = Tensor::from_slice_cuda(&data, DType::F32, &[1024], &stream).unwrap();
    sender.send_on(&tensor, &stream).unwrap();
    let received = receiver.recv_timeout(TIMEOUT).unwrap();
    assert_eq!(received.to_vec::<f32>().unwrap(), data);
}
