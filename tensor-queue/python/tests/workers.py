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
