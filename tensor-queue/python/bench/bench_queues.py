"""tensor_queue against torch.multiprocessing's SimpleQueue and Queue, in one run.

    python3 bench_queues.py [--quick] [--json OUT.json]

Each figure runs both sides in real processes (spawn). Round trips: the parent sends, an echo
process sends what it received back; p50 over the iterations. Streaming: a producer makes a
fresh tensor per message and sends it; the consumer receives and reads each; messages per second.
Broadcast: one 1 GiB tensor to three consumers; seconds until all three have read it.
tensor_queue's figures come twice: the copy path (tensors from torch's caching allocator, copied
once into channel memory at send) and the zero-copy path (tensors made inside
``tq.shareable()``). The echo sends on what it received, which tensor-queue copies (a received
GPU tensor is never forwarded as it is).

The Rust figures of the same run come from ``tq-bench --only rtt`` (the bundle's ``bin/tq-bench``,
or ``--tq-bench PATH``); the cost of the Python layer is shown per hop as (Python - Rust) / 2
(Rust's echo answers with an ack rather than sending the tensors back, so this is an upper
bound), with the receive side measured directly: from the end of Rust's decode
(``recv_with_info()["decoded_ns"]``) to ``recv`` returning the Python objects.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
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


def make(kind: str, shareable: bool = False):  # noqa: ANN201
    if shareable:
        with tq.shareable():
            return make(kind)
    if kind == "4KB":
        return torch.ones(1024, device=DEVICE)
    return {f"t{i}": torch.full((1024,), float(i), device=DEVICE) for i in range(16)}


def rtt_tq(kind: str, n: int, spin: float, shareable: bool = False) -> dict[str, float]:
    """p50 round trip, p50 `send()` call and p50 Python receive-side cost (after Rust's decode), in us."""
    inbox, outbox = address(), address()
    replies = tq.Receiver.bind(outbox)
    replies.set_spin(spin)
    child = mp.get_context("spawn").Process(target=tq_echo, args=(inbox, outbox, spin))
    child.start()
    sender = connect(inbox)
    msg = make(kind, shareable)
    sync()
    times, sends, python_recv = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        sender.send(msg)
        t1 = time.perf_counter()
        back, info = replies.recv_with_info(timeout=60)
        done_ns = time.monotonic_ns()
        t2 = time.perf_counter()
        times.append(t2 - t0)
        sends.append(t1 - t0)
        python_recv.append((done_ns - info["decoded_ns"]) * 1e-9)
        del back
    sender.close()
    child.join(60)
    replies.close()
    p50 = lambda xs: statistics.median(xs[n // 10 :]) * 1e6  # noqa: E731
    return {"rtt": p50(times), "send_call": p50(sends), "python_recv": p50(python_recv)}


def rust_round_trips(tq_bench: str | None, trips: int) -> dict[tuple[int, bool], float]:
    """{(tensors, spin): p50 us} from `tq-bench --only rtt` in this run; empty where it is missing."""
    if not tq_bench or not os.path.exists(tq_bench):
        print(f"Rust figures skipped: no tq-bench at {tq_bench} (pass --tq-bench PATH)", flush=True)
        return {}
    out = tempfile.mkdtemp(prefix="tq-bench-rtt-")
    done = subprocess.run(
        [tq_bench, "--only", "rtt", "--out", out, "--trips", str(trips)], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        print(f"Rust figures skipped: tq-bench failed ({done.returncode}): {done.stderr[-2000:]}", flush=True)
        return {}
    with open(os.path.join(out, "bench.json")) as f:
        runs = json.load(f).get("round_trips", [])
    return {(r["tensors"], bool(r["spin"])): float(r["stats"]["p50_us"]) for r in runs}


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


def stream_tq(n: int, shareable: bool = False) -> float:
    inbox, done = address(), address()
    finished = tq.Receiver.bind(done)
    child = mp.get_context("spawn").Process(target=tq_stream_consumer, args=(inbox, n, done))
    child.start()
    sender = connect(inbox)
    sync()
    keep = []
    t0 = time.perf_counter()
    for i in range(n):
        if shareable:
            with tq.shareable():
                x = torch.full((FIVE_MB,), 1.0, device=DEVICE)
            # torch may give a freed pool block to the next tensor while the consumer still reads
            # it: keep the last ones alive (the consumer holds at most its capacity, 16).
            keep.append(x)
            if len(keep) > 32:
                keep.pop(0)
        else:
            x = torch.full((FIVE_MB,), 1.0, device=DEVICE)
        sender.send(x)
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


def broadcast_tq(reps: int, shareable: bool = False) -> float:
    inboxes, done = [address() for _ in range(3)], address()
    replies = tq.Receiver.bind(done)
    children = [mp.get_context("spawn").Process(target=tq_big_consumer, args=(p, done)) for p in inboxes]
    for c in children:
        c.start()
    broadcast = tq.Broadcast([connect(p) for p in inboxes])
    if shareable:
        with tq.shareable():
            w = torch.ones(256 * 1024 * 1024, device=DEVICE)
    else:
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
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument(
        "--tq-bench",
        default=os.environ.get("TQ_BENCH", os.path.join(here, "..", "..", "bin", "tq-bench")),
        help="the Rust benchmark binary for the same run's Rust figures (default: the GPU bundle's bin/tq-bench)",
    )
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
    # The copy path keeps the rows' earlier names; the zero-copy path (CUDA only) adds its own.
    paths = [("", False)] + ([(", zero copy", True)] if CUDA else [])
    if "rtt" in only:
        rust = rust_round_trips(args.tq_bench, n)
        layer = []
        for kind, tensors in (("4KB", 1), ("16 tensors", 16)):
            simple = rtt_torch(kind, n, "SimpleQueue")
            queue = rtt_torch(kind, n, "Queue")
            for mode, spin in (("spin", 50e-6), ("blocking", 0.0)):
                for path, shareable in paths:
                    got = rtt_tq(kind, n, spin, shareable)
                    row(f"round trip p50, {kind}, {mode}{path}", "us", got["rtt"], simple, queue, "lower")
                    rust_p50 = rust.get((tensors, spin > 0))
                    layer.append(
                        {
                            "benchmark": f"{kind}, {mode}{path or ', copy path'}",
                            "python_rtt_us": got["rtt"],
                            "rust_rtt_us": rust_p50,
                            "python_minus_rust_per_hop_us": (got["rtt"] - rust_p50) / 2 if rust_p50 else None,
                            "send_call_us": got["send_call"],
                            "python_recv_side_us": got["python_recv"],
                        }
                    )
        print("\nthe Python layer (p50, us): Python RTT | Rust RTT (tq-bench, same run) | (Python - Rust) / 2 per hop | "
              "send() call | receive side after Rust's decode")
        for item in layer:
            rust_text = f"{item['rust_rtt_us']:8.1f}" if item["rust_rtt_us"] else "     n/a"
            hop = item["python_minus_rust_per_hop_us"]
            hop_text = f"{hop:8.1f}" if hop is not None else "     n/a"
            print(
                f"  {item['benchmark']:36s} {item['python_rtt_us']:8.1f} | {rust_text} | {hop_text} | "
                f"{item['send_call_us']:8.1f} | {item['python_recv_side_us']:8.1f}",
                flush=True,
            )
        rows.append({"python_layer": layer})
    if "stream" in only:
        m = 100 if args.quick else 300
        simple, queue = stream_torch(m, "SimpleQueue"), stream_torch(m, "Queue")
        for path, shareable in paths:
            row(f"fresh 5 MB tensors streamed ({'zero copy' if shareable else 'copy path'})", "msg/s", stream_tq(m, shareable), simple, queue, "higher")
    if "broadcast" in only and CUDA:
        torch_ms = broadcast_torch(2) * 1e3
        for path, shareable in paths:
            row(f"1 GiB to 3 consumers ({'zero copy' if shareable else 'copy path'})", "ms", broadcast_tq(2, shareable) * 1e3, None, torch_ms, "lower")
    print("stats of this process:", tq.stats())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
