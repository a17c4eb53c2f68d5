"""Functions run in child processes by the tests (importable by spawn and forkserver children)."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import tensor_queue as tq


def every_kind() -> dict:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    return {
        "none": None,
        "bools": [True, False],
        "ints": (0, -1, 2**63 - 1, -(2**63), 2**100, -(2**80)),
        "float": 1.5,
        "str": "héllo",
        "bytes": b"\x00\xff",
        "empty": ([], (), {}),
        "nested": {"box": [a, {"deep": (a[1], a[:, 1, ::2])}]},
        (1, "k"): "tuple key",
        3: "int key",
        "dtypes": [np.ones(3, dtype=d) for d in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")],
        "strided": a.transpose(2, 0, 1),
        "zero_size": np.zeros((0, 3), dtype=np.int32),
        "zero_d": np.array(7, dtype=np.int64),
        "scalar": np.float64(2.5),
        "np_scalar": np.int32(-4),
    }


def produce(q: tq.Queue, n: int) -> None:
    for i in range(n):
        q.put({"i": i, "x": np.full(4, i, dtype=np.int64)})


def produce_every_kind(q: tq.Queue) -> None:
    q.put(every_kind())


def send_then_die(address: str) -> None:
    sender = tq.Sender.connect(address)
    sender.send({"last": np.arange(3)})
    os.kill(os.getpid(), signal.SIGKILL)


def hold_then_die(address: str, ready) -> None:  # noqa: ANN001
    with tq.Receiver.bind(address) as receiver:
        held = receiver.recv(timeout=30)
        ready.set()
        assert held["x"].sum() >= 0
        time.sleep(60)


def block_in_recv(address: str, ready) -> None:  # noqa: ANN001
    receiver = tq.Receiver.bind(address)
    ready.set()
    try:
        receiver.recv()
    except KeyboardInterrupt:
        sys.exit(42)
    sys.exit(1)


def consume(q: tq.Queue, result) -> None:  # noqa: ANN001
    try:
        q.get(timeout=5)
        result.put("got")
    except tq.NotTheConsumer as e:
        result.put("NotTheConsumer: " + str(e))
    except Exception as e:  # noqa: BLE001
        result.put(f"{type(e).__name__}: {e}")


def broadcast_worker(address: str, out: tq.Queue) -> None:
    with tq.Receiver.bind(address) as receiver:
        weights = receiver.recv(timeout=30)
        out.put({"pid": os.getpid(), "sum": float(weights["w"].sum()), "writeable": weights["w"].flags.writeable})
        del weights


def produce_many(q: tq.Queue, n: int) -> None:
    x = np.ones(256, dtype=np.float32)
    for i in range(n):
        q.put((i, x))


def produce_torch(q: tq.Queue, n: int) -> None:
    import torch

    for i in range(n):
        q.put({"i": i, "x": torch.full((4,), i, dtype=torch.int64)})


# --- GPU workers (torch with CUDA) ---


SEED_SHAPE = (2048, 2048)


def gpu_seed_consume(address: str, skip_ordering: bool, out) -> None:  # noqa: ANN001
    """The seed scenario's consumer, in a process of its own so that the test switch (read once a
    process) applies to it alone. Its checksum kernels are launched on the current stream the
    moment `recv` returns, with no torch synchronisation in between: only the channel's ordering
    keeps them after the producer's queued work."""
    if skip_ordering:
        # The negative control: receivers skip the stream wait (a `test-switches` build only).
        os.environ["TENSOR_QUEUE_TEST_SKIP_ORDERING"] = "1"
    import torch

    with tq.Receiver.bind(address) as receiver:
        # Warm up: map the producer's memory and give the block back, so the real message reuses
        # it with no mapping or allocation (which may wait for the device) on either side.
        warm = receiver.recv(timeout=120)
        stale = float(torch.sum(warm["x"], dtype=torch.float64))
        del warm
        torch.cuda.synchronize()
        msg = receiver.recv(timeout=120)
        x = msg["x"]
        total = torch.sum(x, dtype=torch.float64)  # launched at once on the current stream
        norm = torch.linalg.vector_norm(x, dtype=torch.float64)
        got = {"sum": float(total), "norm": float(norm)}
        out.put(
            {
                "who": "consumer",
                **got,
                "stale_sum": stale,
                "step": msg["step"],
                "cuda": x.is_cuda,
                "test_switches": tq._native.test_switches(),
            }
        )
        del msg, x
        torch.cuda.synchronize()


def gpu_seed_produce(address: str, seed: int, out) -> None:  # noqa: ANN001
    """The seed scenario's producer: y is still being computed (a long sleep, then matmuls, queued)
    when it is sent; the copy into channel memory is queued behind that work."""
    import torch

    deadline = time.monotonic() + 60
    while True:
        try:
            sender = tq.Sender.connect(address)
            break
        except tq.TensorQueueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    torch.manual_seed(seed)
    a = torch.randn(*SEED_SHAPE, device="cuda")

    def compute(sleep_cycles: int) -> torch.Tensor:
        y = torch.zeros(*SEED_SHAPE, device="cuda")
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)  # the queue is busy: what follows runs well after send returns
        y.copy_(a)
        for _ in range(8):
            y = y @ a / 64.0
        return y

    compute(0)  # torch's caching allocator holds the blocks the real run needs
    # Stale data of the same size (all -1) sent, read and given back: the real message reuses the
    # block, so its send maps and allocates nothing.
    sender.send({"x": torch.full(SEED_SHAPE, -1.0, device="cuda")}, timeout=60)
    torch.cuda.synchronize()
    if not sender.wait_released(120):
        raise RuntimeError("the consumer did not give the warm-up tensor back within 120 s")
    y = compute(1_000_000_000)  # about half a second of queued work on an H100
    sender.send({"x": y, "step": 3}, timeout=60)
    torch.cuda.synchronize()
    st = tq.stats()
    paths = (
        f"exchange_api={st['send_exchange_api']} dlpack_fallback={st['send_dlpack_fallback']} "
        f"(torch's exchange table usable here: {tq._native.has_exchange_api(y)}, torch {torch.__version__})"
    )
    out.put({"who": "producer", "sum": float(y.double().sum()), "norm": float(y.double().norm()), "paths": paths})
    sender.wait_released(120)  # the consumer has read it: the channel can close


def gpu_receive_from_dying_producer(log) -> None:  # noqa: ANN001
    """The consumer of a producer killed with work queued, in its own process (a stream left
    waiting forever would hang every later test of the process it ran in). Says each step on
    `log` with the seconds since it started; its last line is `ok` or `fail WHY`."""
    import multiprocessing
    import tempfile
    import uuid

    import torch

    start = time.monotonic()

    def say(line: str) -> None:
        log.put(f"{time.monotonic() - start:.2f}s {line}")

    path = os.path.join(tempfile.gettempdir(), f"tq-dying-{uuid.uuid4().hex[:12]}.sock")
    with tq.Receiver.bind(path) as receiver:
        producer = multiprocessing.get_context("spawn").Process(target=gpu_send_then_die, args=(path,))
        producer.start()
        producer.join(120)
        if producer.is_alive():
            producer.kill()
            say("fail the producer was still alive after 120 s (killed)")
            return
        say(f"producer exit code {producer.exitcode}")
        try:
            msg = receiver.recv(timeout=30)
        except (tq.ProducerFailed, tq.Disconnected) as e:
            say(f"recv raised {type(e).__name__}: {e}")
        else:
            say(f"recv delivered x (device {msg['x'].device}, {msg['x'].numel()} elements)")
            done = torch.cuda.Event()
            total = msg["x"].sum()
            done.record()
            deadline = time.monotonic() + 30
            heard = set()
            while not done.query():
                if time.monotonic() > deadline:
                    say(f"fail work on the dead producer's tensor not runnable after 30 s; errors {receiver.take_errors()}")
                    return
                try:
                    receiver.try_recv()  # lets the receiver hear the hang-up
                except (tq.Empty, tq.Disconnected, tq.ProducerFailed) as e:
                    if type(e) is not tq.Empty and type(e).__name__ not in heard:
                        heard.add(type(e).__name__)
                        say(f"try_recv raised {type(e).__name__}: {e}")
                time.sleep(0.01)
            say(f"work on it ran: sum {float(total)}")
            if float(total) not in (0.0, float(1 << 20)):
                say(f"fail the sum {float(total)} is neither the old data (0) nor the finished data ({1 << 20})")
                return
        # Nothing sticky: this process's GPU still works.
        say(f"a fresh tensor sums to {float(torch.ones(4, device='cuda').sum())}")
        say(f"errors {receiver.take_errors()}")
    say("ok")


def gpu_send_then_die(address: str) -> None:
    import torch

    sender = tq.Sender.connect(address)
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued work
    x.fill_(1.0)
    sender.send({"x": x})
    os.kill(os.getpid(), signal.SIGKILL)


def gpu_hold_then_die(address: str, ready) -> None:  # noqa: ANN001
    import torch

    with tq.Receiver.bind(address) as receiver:
        held = receiver.recv(timeout=60)
        assert float(held["x"].sum()) == float(held["x"].numel())
        ready.set()
        time.sleep(120)
        torch.cuda.synchronize()


def gpu_consume_many(address: str, n: int, out) -> None:  # noqa: ANN001
    import torch

    with tq.Receiver.bind(address, capacity=64) as receiver:
        total = torch.zeros((), dtype=torch.float64, device="cuda")
        first_allocated = None
        for i in range(n):
            msg = receiver.recv(timeout=120)
            total += torch.sum(msg["x"], dtype=torch.float64)  # on the GPU, no CPU wait
            del msg
            if i == 1000:
                torch.cuda.synchronize()
                first_allocated = tq.memory.usage()["device_bytes"]
        torch.cuda.synchronize()
        out.put({"first": first_allocated, "last": tq.memory.usage()["device_bytes"], "total": float(total)})


def gpu_write_back(address: str, done) -> None:  # noqa: ANN001
    with tq.Receiver.bind(address) as receiver:
        msg = receiver.recv(timeout=60)
        msg["x"].fill_(5.0)
        import torch

        torch.cuda.synchronize()
        done.set()
        time.sleep(2)


def gpu_add_one_in_place(address: str, done) -> None:  # noqa: ANN001
    """Adds 1 in place to every tensor of the message it receives, then says so (after a sync)."""
    import torch

    with tq.Receiver.bind(address) as receiver:
        msg = receiver.recv(timeout=60)
        for tensor in msg.values():
            tensor.add_(1)
        torch.cuda.synchronize()
        done.set()
        del msg
        torch.cuda.synchronize()


def gpu_receive_on(address: str, ordinal: int, out) -> None:  # noqa: ANN001
    import torch

    torch.cuda.set_device(ordinal)
    with tq.Receiver.bind(address) as receiver:
        msg = receiver.recv(timeout=60)
        out.put({"device": str(msg["x"].device), "sum": float(msg["x"].sum())})
