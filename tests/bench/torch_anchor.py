"""PyTorch anchors for tq-bench, measured the way tq-bench measures tensor-queue.

1. Round trip: torch.multiprocessing SimpleQueue, a 4 KB CUDA tensor to a consumer that
   synchronises and answers with an int (GPU.md: p50 160 us, p99 580 us on an H200).
2. Streaming: mp.Queue(maxsize=16) of freshly allocated 5 MB CUDA tensors; the consumer
   synchronises each; items per second and put-to-usable latency on CLOCK_MONOTONIC. The consumer
   initialises CUDA and takes WARMUP items before the measured ones, so neither its start-up nor
   its first IPC opens are counted (tq-bench warms up the same way).

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
    torch.empty(1, device="cuda")
    out.put("ready")
    done = []
    for _ in range(WARMUP + count):
        sent, x = queue.get()
        torch.cuda.synchronize()
        done.append((sent, time.monotonic_ns()))
        del x
    out.put(done[WARMUP:])


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def main():
    ctx = mp.get_context("spawn")
    device = torch.device("cuda", 0)

    requests, answers = ctx.SimpleQueue(), ctx.SimpleQueue()
    consumer = ctx.Process(target=echo, args=(requests, answers))
    consumer.start()
    def round_trips(message):
        torch.cuda.synchronize()
        trips = []
        for i in range(WARMUP + TRIPS):
            start = time.perf_counter_ns()
            requests.put(message)
            answers.get()
            if i >= WARMUP:
                trips.append(time.perf_counter_ns() - start)
        return trips

    trips = round_trips(torch.ones(1024, dtype=torch.float32, device=device))
    trips16 = round_trips([torch.ones(1024, dtype=torch.float32, device=device) for _ in range(16)])
    requests.put(None)
    consumer.join()

    queue, out = ctx.Queue(maxsize=16), ctx.Queue()
    consumer = ctx.Process(target=drain, args=(queue, out, ITEMS))
    consumer.start()
    assert out.get() == "ready"
    for i in range(WARMUP + ITEMS):
        y = torch.empty(5 << 20, dtype=torch.uint8, device=device)
        y.fill_(i % 256)
        queue.put((time.monotonic_ns(), y))
        del y
    done = out.get()
    latencies = [finished - sent for sent, finished in done]
    seconds = (done[-1][1] - done[0][0]) / 1e9
    consumer.join()

    print(json.dumps({
        "torch": torch.__version__,
        "simplequeue_rtt_p50_us": percentile(trips, 50) / 1e3,
        "simplequeue_rtt_p99_us": percentile(trips, 99) / 1e3,
        "simplequeue_rtt_p999_us": percentile(trips, 99.9) / 1e3,
        "simplequeue_rtt16_p50_us": percentile(trips16, 50) / 1e3,
        "simplequeue_rtt16_p99_us": percentile(trips16, 99) / 1e3,
        "simplequeue_rtt_quantiles_us": [percentile(trips, q / 10) / 1e3 for q in range(1001)],
        "queue_items_per_s": ITEMS / seconds,
        "queue_latency_p50_us": percentile(latencies, 50) / 1e3,
        "queue_latency_p99_us": percentile(latencies, 99) / 1e3,
    }))


if __name__ == "__main__":
    main()
