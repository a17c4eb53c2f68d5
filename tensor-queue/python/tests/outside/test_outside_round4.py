"""Round 4 of the outside tests, from the docs only (README, docstrings, ``_native.pyi``): values
the docs do not list (subclasses of the listed types, lone surrogates, bytearray, memoryview,
huge ints), the channel still usable after each; a child SIGKILLed while the parent holds its
messages; exceptions caught by their builtin names as documented; iterator ends; arguments out of
range; host arrays over TCP (64 MiB, many arrays in one message, a receiver holding many)."""

import collections
import enum
import os
import queue
import signal
import socket

import numpy as np
import pytest

import tensor_queue as tq

from .conftest import program


class Color(enum.IntEnum):
    RED = 1


class Point(collections.namedtuple("Point", "x y")):
    pass


class Name(str):
    pass


class Celsius(float):
    pass


class Stack(list):
    pass


# Values outside the documented list ("None, bool, int, float, str, bytes, list, tuple, dict and
# arrays ... Types are kept ...; anything else raises NotSendable"): each must either raise
# NotSendable or come back as exactly the type it was, never silently as another type.
SUBCLASSES = {
    "namedtuple": lambda: Point(1, 2),
    "int_enum": lambda: Color.RED,
    "str_subclass": lambda: Name("ada"),
    "float_subclass": lambda: Celsius(21.5),
    "list_subclass": lambda: Stack([1, 2]),
}


@pytest.mark.parametrize("name", list(SUBCLASSES))
def test_subclasses_of_listed_types_are_refused_or_kept(name, sock_path):
    value = SUBCLASSES[name]()
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        try:
            s.send({"v": value})
        except tq.NotSendable as e:
            assert "v" in str(e), f"the error does not say where: {e}"
        else:
            got = r.recv(timeout=10)["v"]
            assert type(got) is type(value), f"{value!r} ({type(value).__name__}) arrived as {got!r} ({type(got).__name__})"
            assert got == value
        s.send("after")
        assert r.recv(timeout=10) == "after"


UNLISTED = {
    "bytearray": lambda: bytearray(b"abc"),
    "memoryview": lambda: memoryview(b"abc"),
    "complex": lambda: 1 + 2j,
    "frozenset": lambda: frozenset({1}),
    "range": lambda: range(3),
    "type": lambda: int,
    "generator": lambda: (i for i in range(3)),
    "lone_surrogate": lambda: "a\ud800b",
    "lone_surrogate_key": lambda: {"k\udfff": 1},
    "cyclic_dict": lambda: (lambda d: (d.__setitem__("self", d), d)[1])({}),
}


@pytest.mark.parametrize(
    "name",
    list(UNLISTED),
)
def test_unlisted_values_raise_not_sendable_and_the_channel_goes_on(name, sock_path):
    value = UNLISTED[name]()
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        try:
            s.send({"where": [value]})
        except tq.NotSendable as e:
            assert isinstance(e, TypeError)
            assert "where" in str(e), f"the error does not say where: {e}"
        else:
            # Not refused: then it must arrive as itself.
            got = r.recv(timeout=10)["where"][0]
            assert type(got) is type(value) and got == value, f"{value!r} arrived as {got!r}"
        s.send("after")
        assert r.recv(timeout=10) == "after"
        with pytest.raises(tq.Empty):
            r.try_recv()


@pytest.mark.parametrize("value", [2**63 - 1, -(2**63), 2**64, -(2**64) - 1, 2**200, -(2**4000)], ids=repr)
def test_ints_of_any_size_round_trip_or_are_not_sendable(value, sock_path):
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        try:
            s.send(value)
        except tq.NotSendable:
            pass
        else:
            got = r.recv(timeout=10)
            assert type(got) is int and got == value
        s.send(1)
        assert r.recv(timeout=10) == 1


# ---------------------------------------------------------------------------------------------
# Exceptions caught by the builtin names the docs give them.


def test_errors_are_caught_by_their_builtin_names(sock_path):
    with tq.Receiver.bind(sock_path, capacity=1) as r:
        try:
            r.try_recv()
        except queue.Empty as e:
            assert isinstance(e, tq.Empty) and isinstance(e, tq.TensorQueueError)
        else:
            pytest.fail("try_recv on nothing did not raise")
        try:
            r.recv(timeout=0.05)
        except TimeoutError as e:
            assert isinstance(e, tq.Timeout)
        else:
            pytest.fail("recv(timeout) on nothing did not raise")
        s = tq.Sender.connect(sock_path)
        full = None
        for i in range(64):
            try:
                s.try_send(i)
            except queue.Full as e:
                full = e
                break
        assert isinstance(full, tq.Full), "try_send never raised queue.Full with capacity 1"
        s.close()
        with pytest.raises(tq.Closed):
            s.send(1)
        got = [r.recv(timeout=10) for _ in range(i)]
        assert got == list(range(i))
        # The only sender closed: recv says the peer is gone, as an EOFError.
        try:
            r.recv(timeout=10)
        except EOFError as e:
            assert isinstance(e, tq.Disconnected)
        else:
            pytest.fail("recv after every sender closed did not raise")


@pytest.mark.parametrize("capacity", [-1, 2**40, 2**64])
def test_out_of_range_capacity_is_invalid_argument(capacity, sock_path):
    with pytest.raises(tq.InvalidArgument):
        tq.Receiver.bind(sock_path, capacity=capacity)
    # The address is still free afterwards.
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        s.send(1)
        assert r.recv(timeout=10) == 1


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf") * -1])
def test_bad_connect_timeout_is_invalid_argument(timeout, sock_path):
    with tq.Receiver.bind(sock_path):
        with pytest.raises(tq.InvalidArgument):
            tq.Sender.connect(sock_path, timeout=timeout)


def test_iteration_end_is_sticky_and_a_closed_receiver_raises_closed(sock_path):
    r = tq.Receiver.bind(sock_path)
    with tq.Sender.connect(sock_path) as s:
        for i in range(3):
            s.send(i)
    it = iter(r)
    assert list(it) == [0, 1, 2]
    # Asking again after the end ends again at once, it does not wait.
    with pytest.raises(StopIteration):
        next(it)
    r.close()
    with pytest.raises(tq.Closed):
        r.recv(timeout=1)
    with pytest.raises(tq.Closed):
        next(iter(r))


# ---------------------------------------------------------------------------------------------
# A child killed while the parent holds its messages.

CHILD_SENDS = r"""
import sys, time
import numpy as np
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
for i in range(12):
    s.send({"i": i, "a": np.full(1 << 20, i, dtype=np.int32), "v": np.arange(i * 10, dtype=np.float64)[::-2]})
print("sent", flush=True)
time.sleep(600)
"""


def test_child_sigkilled_while_parent_holds_its_messages(sock_path):
    r = tq.Receiver.bind(sock_path)
    child = program(CHILD_SENDS, sock_path)
    try:
        held = [r.recv(timeout=30) for _ in range(12)]
        assert child.stdout.readline().strip() == "sent"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        # What the parent holds is whole and unchanged after the child died.
        for i, m in enumerate(held):
            assert m["i"] == i
            assert m["a"].shape == (1 << 20,) and int(m["a"].min()) == i and int(m["a"].max()) == i
            np.testing.assert_array_equal(m["v"], np.arange(i * 10, dtype=np.float64)[::-2])
            assert not m["a"].flags.writeable
        # The end is seen, promptly, as an EOFError; iteration ends.
        with pytest.raises(EOFError):
            r.recv(timeout=30)
        assert list(r) == []
        # The arrays outlive the receiver too.
        r.close()
        assert sum(int(m["a"][0]) for m in held) == sum(range(12))
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)


# ---------------------------------------------------------------------------------------------
# Host arrays across "hosts" (TCP on 127.0.0.1).

SECRET = "round4-secret-round4-secret-0123"

TCP_SEND = r"""
import sys
import numpy as np
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
big = (np.arange(64 << 20, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
s.send({"big": big, "sum": int(big.sum(dtype=np.uint64))})
s.send([np.full(i % 7, i, dtype=np.int16) for i in range(2000)])
for i in range(100):
    s.send({"i": i, "a": np.full((3, 5), i, dtype=np.float32).T})
s.close()
print("closed", flush=True)
"""


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tcp_host_arrays_large_many_and_held(monkeypatch):
    monkeypatch.setenv("TQ_SECRET", SECRET)
    addr = f"tcp://127.0.0.1:{_free_port()}"
    r = tq.Receiver.bind(addr, capacity=8)
    child = program(TCP_SEND, addr, env={"TQ_SECRET": SECRET})
    try:
        first = r.recv(timeout=60)
        assert first["big"].shape == (64 << 20,) and first["big"].dtype == np.uint8
        assert int(first["big"].sum(dtype=np.uint64)) == first["sum"]
        many = r.recv(timeout=60)
        assert len(many) == 2000
        for i, a in enumerate(many):
            assert a.dtype == np.int16 and a.shape == (i % 7,) and (a == i).all()
        held = [r.recv(timeout=60) for _ in range(100)]
        out, err = child.communicate(timeout=60)
        assert "closed" in out, err
        for i, m in enumerate(held):
            assert m["i"] == i and m["a"].shape == (5, 3) and (m["a"] == i).all()
        with pytest.raises(EOFError):
            r.recv(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=30)
        r.close()


# ---------------------------------------------------------------------------------------------
# Arrays whose logical size no memory can hold (a broadcast view of one element): refused typed,
# never the end of the process. Run in a separate program, since the failure seen is an abort.

HUGE_BROADCAST = r"""
import sys
import numpy as np
import tensor_queue as tq
r = tq.Receiver.bind(sys.argv[1])
s = tq.Sender.connect(sys.argv[1])
n, dtype = int(sys.argv[2]), np.dtype(sys.argv[3])
a = np.broadcast_to(np.zeros(1, dtype), (n,))
try:
    s.send({"a": a}, timeout=10)
    print("sent", flush=True)
except tq.TensorQueueError as e:
    print("refused", type(e).__name__, flush=True)
s.send("after")
print("after", r.recv(timeout=10), flush=True)
"""


@pytest.mark.parametrize("n,dtype", [(2**62, "uint8"), (2**46, "int64")], ids=["2^62 uint8", "2^46 int64"])
def test_a_broadcast_array_larger_than_memory_is_refused_typed(n, dtype, sock_path):
    prog = program(HUGE_BROADCAST, sock_path, n, dtype)
    try:
        out, err = prog.communicate(timeout=60)
    except Exception:
        prog.kill()
        prog.communicate()
        raise
    assert prog.returncode == 0, f"the sending process died ({prog.returncode}): {err[-500:]}"
    assert out.startswith("refused "), out
    assert "after after" in out, out


# ---------------------------------------------------------------------------------------------
# TCP: a sending program killed mid-transfer of a large array, beside another sending program.

TCP_BIG_SENDER = r"""
import sys
import numpy as np
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
big = np.ones(256 << 20, dtype=np.uint8)
print("sending", flush=True)
s.send({"who": "big", "a": big})
print("sent", flush=True)
import time; time.sleep(600)
"""

TCP_SMALL_SENDER = r"""
import sys, time
import numpy as np
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
for i in range(40):
    s.send({"who": "small", "i": i, "a": np.full(1 << 16, i, dtype=np.int32)})
    time.sleep(0.02)
s.close()
print("closed", flush=True)
"""


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_tcp_sender_program_killed_mid_array_costs_the_other_nothing(monkeypatch):
    import threading
    import time

    monkeypatch.setenv("TQ_SECRET", SECRET)
    addr = f"tcp://127.0.0.1:{_free_port()}"
    r = tq.Receiver.bind(addr, capacity=4)
    smalls, bigs, failures = [], [], []

    def receive():
        # Until every sender has gone (EOFError) or nothing came for 30 s.
        while True:
            try:
                m = r.recv(timeout=30)
            except (TimeoutError, EOFError):
                return
            except Exception as e:  # reported below
                failures.append(e)
                return
            if m["who"] == "small":
                if not (m["a"] == m["i"]).all():
                    failures.append(f"small {m['i']} torn")
                smalls.append(m["i"])
            else:
                bigs.append(m)

    before = _rss()
    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    big = program(TCP_BIG_SENDER, addr, env={"TQ_SECRET": SECRET})
    small = program(TCP_SMALL_SENDER, addr, env={"TQ_SECRET": SECRET})
    try:
        assert big.stdout.readline().strip() == "sending"
        # Kill it once this receiver holds 64 MiB more than before (its host memory is backed as
        # the bytes arrive; the other program sends 10 MiB in all): mid-transfer.
        deadline = time.monotonic() + 60
        while _rss() < before + (64 << 20) and not bigs:
            assert time.monotonic() < deadline, "the big array never started arriving"
            time.sleep(0.001)
        os.kill(big.pid, signal.SIGKILL)
        big.wait(timeout=30)
        reader.join(timeout=120)
        assert not reader.is_alive(), "recv hung"
        assert not failures, failures
        assert smalls == list(range(40)), "the other program's messages, all and in order"
        # The killed one's message arrived whole (it may have finished) or is reported lost.
        for m in bigs:
            assert m["a"].shape == (256 << 20,) and bool(m["a"].all())
        out, err = small.communicate(timeout=60)
        assert "closed" in out, err
        if not bigs:
            errors = r.take_errors()
            if not errors:
                try:
                    r.recv(timeout=3)
                except (TimeoutError, EOFError):
                    pass
                errors = r.take_errors()
            assert errors and all(isinstance(e, str) for e in errors), errors
            assert any("unfinished" in e.lower() or "lost" in e.lower() for e in errors), errors
    finally:
        for p in (big, small):
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
        r.close()


# ---------------------------------------------------------------------------------------------
# Addresses.


def test_tcp_port_zero_address_names_the_port_bound(monkeypatch):
    monkeypatch.setenv("TQ_SECRET", SECRET)
    with tq.Receiver.bind("tcp://127.0.0.1:0") as r:
        # "The address it was bound to": one a sender can connect to.
        assert not r.address.endswith(":0"), r.address
        with tq.Sender.connect(r.address, timeout=10) as s:
            s.send("hi")
            assert r.recv(timeout=10) == "hi"


def test_empty_address_is_invalid_argument():
    with pytest.raises(tq.InvalidArgument):
        tq.Receiver.bind("")


# ---------------------------------------------------------------------------------------------
# Several senders in one process.


def test_several_tcp_senders_of_one_process_in_threads_keep_their_order(monkeypatch):
    import threading

    monkeypatch.setenv("TQ_SECRET", SECRET)
    addr = f"tcp://127.0.0.1:{_free_port()}"
    with tq.Receiver.bind(addr, capacity=4) as r:
        errors = []

        def feed(k):
            try:
                with tq.Sender.connect(addr, timeout=30) as s:
                    for i in range(50):
                        s.send({"k": k, "i": i, "a": np.full(1000 + k, i, dtype=np.float32)}, timeout=30)
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=feed, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        seen = collections.defaultdict(list)
        for _ in range(300):
            m = r.recv(timeout=30)
            assert m["a"].shape == (1000 + m["k"],) and (m["a"] == m["i"]).all()
            seen[m["k"]].append(m["i"])
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert {k: v for k, v in seen.items()} == {k: list(range(50)) for k in range(6)}
        with pytest.raises(EOFError):
            r.recv(timeout=30)


def test_recv_with_info_tells_apart_two_senders_of_one_process(sock_path):
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as a, tq.Sender.connect(sock_path) as b:
        a.send("a")
        b.send("b")
        infos = [r.recv_with_info(timeout=10)[1] for _ in range(2)]
        keys = [tuple(sorted((k, v) for k, v in i.items() if not k.endswith("_ns"))) for i in infos]
        assert keys[0] != keys[1], f"two messages of two senders look the same: {keys}"


# ---------------------------------------------------------------------------------------------
# A Queue's producer killed while the consumer holds its messages.

QUEUE_CHILD = r"""
import pickle, sys, time
import numpy as np
q = pickle.loads(bytes.fromhex(sys.argv[1]))
for i in range(8):
    q.put({"i": i, "a": np.full((256, 256), i, dtype=np.float64)})
print("put", flush=True)
time.sleep(600)
"""


def test_queue_producer_sigkilled_while_consumer_holds_its_messages():
    import pickle

    q = tq.Queue(maxsize=4)
    child = program(QUEUE_CHILD, pickle.dumps(q).hex())
    try:
        held = [q.get(timeout=60) for _ in range(8)]
        assert child.stdout.readline().strip() == "put"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        for i, m in enumerate(held):
            assert m["i"] == i and m["a"].shape == (256, 256) and (m["a"] == i).all()
        with pytest.raises(queue.Empty):
            q.get(timeout=1)
        # Held arrays still read right after the producer's death and a trim.
        tq.memory.trim()
        assert sum(float(m["a"][0, 0]) for m in held) == sum(range(8))
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)


def test_raw_tcp_garbage_is_reported_and_the_receiver_goes_on(monkeypatch):
    import time

    monkeypatch.setenv("TQ_SECRET", SECRET)
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    with tq.Receiver.bind(addr) as r:
        raws = []
        for payload in (b"\xff" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 64):
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            c.sendall(payload)
            raws.append(c)
        with tq.Sender.connect(addr, timeout=30) as s:
            s.send({"ok": np.arange(5)})
            assert r.recv(timeout=30)["ok"].tolist() == [0, 1, 2, 3, 4]
        # Each raw connection is closed by the receiver, within a bound.
        for c in raws:
            c.settimeout(40)
            try:
                while c.recv(4096):
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass
            c.close()
        errors = r.take_errors()
        deadline = time.monotonic() + 20
        while not errors and time.monotonic() < deadline:
            try:
                r.try_recv()
            except (tq.Empty, EOFError):
                pass
            time.sleep(0.05)
            errors = r.take_errors()
        assert errors and all(isinstance(e, str) for e in errors), errors


# ---------------------------------------------------------------------------------------------
# Odd arrays: dimension limits, unaligned data, overlapping and negative strides, zero-size
# shapes with huge dimensions.


def _odd_arrays():
    from numpy.lib.stride_tricks import as_strided

    raw = np.arange(100, dtype=np.uint8).tobytes()
    return {
        "32 dims": np.arange(2, dtype=np.int8).reshape((1,) * 31 + (2,)),
        "unaligned int32": np.frombuffer(raw, dtype=np.int32, count=10, offset=1),
        "zero-size with a 2^40 dim": np.empty((0, 2**40), np.float64),
        "zero-size with a 2^31 zero-stride dim": as_strided(np.zeros(1, np.int8), shape=(2**31, 0), strides=(0, 0)),
        "overlapping strides": as_strided(np.arange(10, dtype=np.int64), shape=(5, 4), strides=(8, 8)),
        "negative strides 2-d": np.arange(12, dtype=np.float32).reshape(3, 4)[::-1, ::-2],
        "0-d int64 max": np.array(2**63 - 1, dtype=np.int64),
        "read-only source": np.frombuffer(b"abcd", dtype=np.uint8),
        "float16 nan, -0, inf": np.array([np.nan, -0.0, np.inf], np.float16),
        "bool strided": np.array([True, False] * 5)[::3],
    }


@pytest.mark.parametrize("name", list(_odd_arrays()))
def test_odd_arrays_round_trip(name, sock_path):
    a = _odd_arrays()[name]
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        s.send({"a": a})
        got = r.recv(timeout=10)["a"]
        assert got.shape == a.shape and got.dtype == a.dtype
        assert np.array_equal(got, a, equal_nan=a.dtype.kind == "f")


@pytest.mark.parametrize("ndim", [33, 40])
def test_more_dims_than_the_limit_is_not_sendable_and_the_channel_goes_on(ndim, sock_path):
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        with pytest.raises(tq.NotSendable) as ei:
            s.send({"deep": np.zeros((1,) * ndim, np.float32)})
        assert "deep" in str(ei.value)
        s.send("after")
        assert r.recv(timeout=10) == "after"
