"""tq.Queue as a torch.multiprocessing user converts to it: children by spawn and forkserver."""

import math
import pickle
import queue

import numpy as np
import pytest

import tensor_queue as tq

from . import _workers


def test_several_producers_one_consumer_order_per_producer(ctx):
    q = tq.Queue(maxsize=8)
    n, producers = 200, 3
    procs = [ctx.Process(target=_workers.produce_ordered, args=(q, p, n)) for p in range(producers)]
    for p in procs:
        p.start()
    last = {p: -1 for p in range(producers)}
    for _ in range(n * producers):
        m = q.get(timeout=60)
        assert m["i"] == last[m["p"]] + 1, "per-producer order broken"
        assert m["a"].tolist() == [m["i"]] * 3
        last[m["p"]] = m["i"]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)


def test_get_timeout_raises_queue_empty():
    q = tq.Queue(maxsize=2)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(tq.Empty):
        q.get(block=False)


def test_put_when_full_timeout_and_nowait_raise_queue_full():
    q = tq.Queue(maxsize=2)
    # become the consumer first so that put has somewhere to go
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    q.put(1)
    q.put(2)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.2)
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    with pytest.raises(tq.Full):
        q.put(3, block=False)
    assert q.get(timeout=5) == 1
    assert q.get(timeout=5) == 2
    q.put(4, timeout=5)  # nothing of the refused puts was sent
    assert q.get(timeout=5) == 4
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)


def test_queue_pickles_and_put_blocks_until_consumer_reads(ctx):
    q = tq.Queue(maxsize=1)
    pickle.dumps(q)  # the docs: it pickles as its address
    p = ctx.Process(target=_workers.put_values, args=(q, list(range(20))))
    p.start()
    got = [q.get(timeout=30) for _ in range(20)]
    p.join(30)
    assert got == list(range(20))
    assert p.exitcode == 0


def _value_tree():
    return {
        "none": None,
        "t": True,
        "f": False,
        "int": -(2**62),
        "big": 2**100,
        "negbig": -(2**80) - 7,
        "float": 1.5,
        "nan": float("nan"),
        "inf": float("inf"),
        "ninf": float("-inf"),
        "str": "héllo ✓ 日本 \U0001f600",
        "empty_str": "",
        "bytes": b"\x00\xffabc",
        "empty_bytes": b"",
        "list": [1, [2, [3, ()]]],
        "tuple": (1, "a", (None,)),
        "empty_tuple": (),
        1: "int key",
        (1, 2): "tuple key",
        None: "none key",
        b"k": "bytes key",
        2.5: "float key",
        "nested": [{"a": (np.arange(3),)}],
    }


def _assert_same(a, b, where="msg"):
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()) or set(map(repr, a)) == set(map(repr, b)), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: {a.shape} != {b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), where
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def test_every_scalar_kind_round_trips_types_exactly(ctx):
    q = tq.Queue(maxsize=4)
    v = _value_tree()
    p = ctx.Process(target=_workers.put_values, args=(q, [v]))
    p.start()
    got = q.get(timeout=60)
    p.join(30)
    _assert_same(v, got)


DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
]
# What the README's Python section lists (the Rust tensor's dtypes).
CARRIED = {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_array_dtypes_round_trip(dtype, sock_path):
    a = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        if np.dtype(dtype).name not in CARRIED:
            # The README lists the dtypes a tensor holds; any other is a NotSendable (a TypeError).
            with pytest.raises(tq.NotSendable, match="cannot hold"):
                s.send(a)
            return
        s.send(a)
        b = r.recv(timeout=10)
    assert isinstance(b, np.ndarray)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.array_equal(a, b)


ARRAYS = {
    "0d": lambda: np.array(3.25),
    "0d_bool": lambda: np.array(True),
    "empty": lambda: np.zeros((0,), np.float32),
    "empty_2d": lambda: np.zeros((3, 0), np.int16),
    "strided": lambda: np.arange(100, dtype=np.int32)[::3],
    "neg_stride": lambda: np.arange(50, dtype=np.float64)[::-1],
    "neg_stride_2d": lambda: np.arange(60, dtype=np.int64).reshape(6, 10)[::-2, ::-3],
    "fortran": lambda: np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
    "transposed": lambda: np.arange(12, dtype=np.uint8).reshape(3, 4).T,
    "broadcast_zero_stride": lambda: np.broadcast_to(np.arange(4), (3, 4)),
    "large_64MiB": lambda: np.arange(8 * 1024 * 1024, dtype=np.float64),
}


@pytest.mark.parametrize("name", list(ARRAYS))
def test_array_layouts_round_trip(name, ctx):
    a = ARRAYS[name]()
    q = tq.Queue(maxsize=2)
    p = ctx.Process(target=_workers.put_values, args=(q, [{"k": a}]))
    p.start()
    b = q.get(timeout=60)["k"]
    p.join(30)
    assert p.exitcode == 0
    assert isinstance(b, np.ndarray)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.array_equal(a, b)
