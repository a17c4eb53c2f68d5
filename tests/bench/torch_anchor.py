"""PyTorch anchors for tq-bench, measured the way tq-bench measures tensor-queue.

1. Round trip: torch.multiprocessing SimpleQueue, a 4 KB CUDA tensor to a consumer that
   synchronises and answers with an int (GPU.md: p50 160 us, p99 580 us on an H200).
2. Streaming: mp.Queue(maxsize=16) of freshly allocated 5 MB CUDA tensors; the consumer
   synchronises each; items per second and put-to-usable latency on CLOCK_MONOTONIC.

Prints one JSON object last.
"""
import json
import os
import time

import torch
import torch.multiprocessing as mp

TRIPS = int(os.environ.get("TORCH_TRIPS", "5000"))
WARMUP = 500
ITEMS = int(os.environ.get("TORCH_ITEMS", "1000"))


def echo(requests, answers):
    while True:
        x = requests.get()
        if x is None:
            break
        torch.cuda.synchronize()
        answers.put(1)
        del x


def drain(queue, out, count):
    latencies = []
    for _ in range(count):
        sent, x = queue.get()
        torch.cuda.synchronize()
        latencies.append(time.monotonic_ns() - sent)
        del x
    out.put(latencies)


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def main():
    ctx = mp.get_context("spawn")
    device = torch.device("cuda", 0)

    requests, answers = ctx.SimpleQueue(), ctx.SimpleQueue()
    consumer = ctx.Process(target=echo, args=(requests, answers))
    consumer.start()
    x = torch.ones(1024, dtype=torch.float32, device=device)
    torch.cuda.synchronize()
    trips = []
    for i in range(WARMUP + TRIPS):
        start = time.perf_counter_ns()
        requests.put(x)
        answers.get()
        if i >= WARMUP:
            trips.append(time.perf_counter_ns() - start)
    requests.put(None)
    consumer.join()

    queue, out = ctx.Queue(maxsize=16), ctx.Queue()
    consumer = ctx.Process(target=drain, args=(queue, out, ITEMS))
    consumer.start()
    start = time.monotonic_ns()
    for i in range(ITEMS):
        y = torch.empty(5 << 20, dtype=torch.uint8, device=device)
        y.fill_(i % 256)
        queue.put((time.monotonic_ns(), y))
        del y
    latencies = out.get()
    seconds = (time.monotonic_ns() - start) / 1e9
    consumer.join()

    print(json.dumps({
        "torch": torch.__version__,
        "simplequeue_rtt_p50_us": percentile(trips, 50) / 1e3,
        "simplequeue_rtt_p99_us": percentile(trips, 99) / 1e3,
        "queue_items_per_s": ITEMS / seconds,
        "queue_latency_p50_us": percentile(latencies, 50) / 1e3,
        "queue_latency_p99_us": percentile(latencies, 99) / 1e3,
    }))


if __name__ == "__main__":
    main()
