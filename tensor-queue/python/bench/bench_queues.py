"""tensor_queue against torch.multiprocessing's SimpleQueue and Queue, in one run.

    python3 bench_queues.py [--quick] [--json OUT.json]

Each figure runs both sides in real processes (spawn). Round trips: the parent sends, an echo
process sends what it received back; p50 over the iterations. Streaming: a producer makes a
fresh tensor per message and sends it; the consumer receives and reads each; messages per second.
Broadcast: one 1 GiB tensor to three consumers; seconds until all three have read it.
tensor_queue's figures are its copy path (zero copy through channel memory is not in this build).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid

import torch
import torch.multiprocessing as tmp

import tensor_queue as tq

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def address() -> str:
    return os.path.join(tempfile.gettempdir(), f"tq-bench-{uuid.uuid4().hex[:12]}.sock")


def connect(path: str) -> tq.Sender:
    deadline = time.monotonic() + 60
    while True:
        try:
            return tq.Sender.connect(path)
        except tq.TensorQueueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


# ---- echo processes ----


def tq_echo(inbox: str, outbox: str, spin: float) -> None:
    receiver = tq.Receiver.bind(inbox)
    receiver.set_spin(spin)
    sender = connect(outbox)
    for msg in receiver:
        sender.send(msg)


def torch_echo(inq, outq) -> None:  # noqa: ANN001
    while True:
        msg = inq.get()
        if msg is None:
            return
        # torch refuses to send on a CUDA tensor it received: it must be cloned first.
        outq.put({k: v.clone() for k, v in msg.items()} if isinstance(msg, dict) else msg.clone())


def make(kind: str):  # noqa: ANN201
    if kind == "4KB":
        return torch.ones(1024, device=DEVICE)
    return {f"t{i}": torch.full((1024,), float(i), device=DEVICE) for i in range(16)}


def rtt_tq(kind: str, n: int, spin: float) -> float:
    inbox, outbox = address(), address()
    replies = tq.Receiver.bind(outbox)
    replies.set_spin(spin)
    child = mp.get_context("spawn").Process(target=tq_echo, args=(inbox, outbox, spin))
    child.start()
    sender = connect(inbox)
    msg = make(kind)
    sync()
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        sender.send(msg)
        back = replies.recv(timeout=60)
        times.append(time.perf_counter() - t0)
        del back
    sender.close()
    child.join(60)
    replies.close()
    return statistics.median(times[n // 10 :]) * 1e6


def rtt_torch(kind: str, n: int, queue_type: str) -> float:
    ctx = tmp.get_context("spawn")
    make_q = ctx.SimpleQueue if queue_type == "SimpleQueue" else ctx.Queue
    inq, outq = make_q(), make_q()
    child = ctx.Process(target=torch_echo, args=(inq, outq))
    child.start()
    msg = make(kind)
    sync()
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        inq.put(msg)
        back = outq.get()
        times.append(time.perf_counter() - t0)
        del back
    inq.put(None)
    child.join(60)
    return statistics.median(times[n // 10 :]) * 1e6


# ---- streaming fresh 5 MB tensors ----

FIVE_MB = 5 * 1024 * 1024 // 4


def tq_stream_consumer(inbox: str, n: int, done: str) -> None:
    receiver = tq.Receiver.bind(inbox, capacity=16)
    acc = torch.zeros((), device=DEVICE)
    for _ in range(n):
        acc += receiver.recv(timeout=120)[0]
    sync()
    connect(done).send(float(acc))


def torch_stream_consumer(q, n: int, done) -> None:  # noqa: ANN001
    acc = torch.zeros((), device=DEVICE)
    for _ in range(n):
        acc += q.get()[0]
    sync()
    done.put(float(acc))


def stream_tq(n: int) -> float:
    inbox, done = address(), address()
    finished = tq.Receiver.bind(done)
    child = mp.get_context("spawn").Process(target=tq_stream_consumer, args=(inbox, n, done))
    child.start()
    sender = connect(inbox)
    sync()
    t0 = time.perf_counter()
    for i in range(n):
        sender.send(torch.full((FIVE_MB,), 1.0, device=DEVICE))
    total = finished.recv(timeout=300)
    elapsed = time.perf_counter() - t0
    child.join(60)
    assert total == n, total
    return n / elapsed


def stream_torch(n: int, queue_type: str) -> float:
    ctx = tmp.get_context("spawn")
    make_q = ctx.SimpleQueue if queue_type == "SimpleQueue" else ctx.Queue
    q, done = make_q(), make_q()
    child = ctx.Process(target=torch_stream_consumer, args=(q, n, done))
    child.start()
    sync()
    t0 = time.perf_counter()
    keep = []
    for i in range(n):
        x = torch.full((FIVE_MB,), 1.0, device=DEVICE)
        q.put(x)
        keep.append(x)  # torch's CUDA IPC needs the producer to keep the tensor until it is used
        if len(keep) > 32:
            keep.pop(0)
    total = done.get()
    elapsed = time.perf_counter() - t0
    child.join(60)
    assert total == n, total
    return n / elapsed


# ---- 1 GiB to 3 consumers ----


def tq_big_consumer(inbox: str, done: str) -> None:
    receiver = tq.Receiver.bind(inbox)
    reply = connect(done)
    while True:
        try:
            msg = receiver.recv(timeout=300)
        except tq.Disconnected:
            return
        value = float(msg["w"][-1])
        del msg
        reply.send(value)


def torch_big_consumer(q, done) -> None:  # noqa: ANN001
    while True:
        msg = q.get()
        if msg is None:
            return
        value = float(msg["w"][-1])
        del msg
        done.put(value)


def broadcast_tq(reps: int) -> float:
    inboxes, done = [address() for _ in range(3)], address()
    replies = tq.Receiver.bind(done)
    children = [mp.get_context("spawn").Process(target=tq_big_consumer, args=(p, done)) for p in inboxes]
    for c in children:
        c.start()
    broadcast = tq.Broadcast([connect(p) for p in inboxes])
    w = torch.ones(256 * 1024 * 1024, device=DEVICE)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        broadcast.send({"w": w})
        for _ in inboxes:
            assert replies.recv(timeout=300) == 1.0
        times.append(time.perf_counter() - t0)
    del broadcast
    for c in children:
        c.join(60)
    return min(times)


def broadcast_torch(reps: int) -> float:
    ctx = tmp.get_context("spawn")
    qs, done = [ctx.Queue() for _ in range(3)], ctx.Queue()
    children = [ctx.Process(target=torch_big_consumer, args=(q, done)) for q in qs]
    for c in children:
        c.start()
    w = torch.ones(256 * 1024 * 1024, device=DEVICE)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for q in qs:
            q.put({"w": w})
        for _ in qs:
            assert done.get() == 1.0
        times.append(time.perf_counter() - t0)
    for q in qs:
        q.put(None)
    for c in children:
        c.join(60)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--only", default="rtt,stream,broadcast")
    args = parser.parse_args()
    n = 300 if args.quick else 2000
    rows = []

    def row(name: str, unit: str, tq_value: float, simple: float | None, queue: float | None, better: str) -> None:
        rows.append({"benchmark": name, "unit": unit, "tensor_queue": tq_value, "SimpleQueue": simple, "Queue": queue})
        ratio = ""
        if queue and not simple:
            ratio = f"{(queue / tq_value if better == 'lower' else tq_value / queue):.1f}x vs Queue"
        if simple:
            ratio = f"{(simple / tq_value if better == 'lower' else tq_value / simple):.1f}x vs SimpleQueue"
        print(f"{name:44s} {tq_value:10.1f} {unit:6s} | SimpleQueue {simple or 0:10.1f} | Queue {queue or 0:10.1f} | {ratio}", flush=True)

    print(f"device: {torch.cuda.get_device_name(0) if CUDA else 'cpu'}; torch {torch.__version__}; python {sys.version.split()[0]}")
    print("torch DLPack C exchange API used:", tq._native.has_exchange_api(torch.empty(0)))
    only = args.only.split(",")
    if "rtt" in only:
        for kind in ("4KB", "16 tensors"):
            simple = rtt_torch(kind, n, "SimpleQueue")
            queue = rtt_torch(kind, n, "Queue")
            row(f"round trip p50, {kind}, spin", "us", rtt_tq(kind, n, 50e-6), simple, queue, "lower")
            row(f"round trip p50, {kind}, blocking", "us", rtt_tq(kind, n, 0.0), simple, queue, "lower")
    if "stream" in only:
        m = 100 if args.quick else 300
        row("fresh 5 MB tensors streamed (copy path)", "msg/s", stream_tq(m), stream_torch(m, "SimpleQueue"), stream_torch(m, "Queue"), "higher")
    if "broadcast" in only and CUDA:
        row("1 GiB to 3 consumers (copy path)", "ms", broadcast_tq(2) * 1e3, None, broadcast_torch(2) * 1e3, "lower")
    print("stats of this process:", tq.stats())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
