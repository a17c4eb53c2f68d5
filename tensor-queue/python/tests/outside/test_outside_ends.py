"""The explicit ends: bind/connect, send/recv/try_recv/recv_with_info, iteration, Broadcast,
memory, doctor, TCP with TQ_SECRET, and values a message cannot carry."""

import collections
import os
import socket

import numpy as np
import pytest

import tensor_queue as tq

from . import _workers
from .conftest import program


class Obj:
    pass


def _recursive():
    x = [1]
    x.append(x)
    return x


class DictSub(dict):
    pass


UNSENDABLE = {
    "object": (lambda: {"box": [1, Obj()]}, "box"),
    "set": (lambda: {"s": {1, 2}}, "s"),
    "lambda": (lambda: [0, lambda: 1], "1"),
    "recursive_list": (_recursive, None),
    "dict_subclass": (lambda: {"d": DictSub(a=1)}, "d"),
    "ordered_dict": (lambda: {"d": collections.OrderedDict(a=1)}, "d"),
    "object_array": (lambda: {"arr": np.array([1, "a"], dtype=object)}, "arr"),
    "structured_dtype": (lambda: {"st": np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])}, "st"),
    "datetime_array": (lambda: {"dt": np.array(["2020-01-01"], dtype="datetime64[D]")}, "dt"),
}


@pytest.mark.parametrize("name", list(UNSENDABLE))
def test_unsendable_is_typeerror_naming_where_nothing_half_sent(name, sock_path):
    make, where = UNSENDABLE[name]
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        s.send("before")
        with pytest.raises(TypeError) as ei:
            s.send(make())
        assert isinstance(ei.value, tq.NotSendable)
        assert isinstance(ei.value, tq.TensorQueueError)
        if where is not None:
            assert where in str(ei.value), f"error does not say where: {ei.value}"
        s.send("after")
        assert r.recv(timeout=5) == "before"
        assert r.recv(timeout=5) == "after"
        with pytest.raises(tq.Empty):
            r.try_recv()


@pytest.mark.parametrize("v", [np.float32(1.5), np.int64(3), np.bool_(True), np.uint8(7)], ids=repr)
def test_numpy_scalars_round_trip_as_themselves(v, sock_path):
    # Not in the documented list; they arrive as the same NumPy scalar type (observed, kept).
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        s.send({"v": v})
        got = r.recv(timeout=5)["v"]
    assert type(got) is type(v) and got == v


def test_send_recv_try_recv_recv_with_info_in_separate_program(sock_path):
    with tq.Receiver.bind(sock_path) as r:
        assert r.address
        with pytest.raises(tq.Empty):
            r.try_recv()
        with pytest.raises(TimeoutError):
            r.recv(timeout=0.1)
        prog = program(
            """
            import sys, numpy as np, tensor_queue as tq
            with tq.Sender.connect(sys.argv[1], timeout=30) as s:
                for i in range(5):
                    s.send({"i": i, "a": np.arange(i + 1)})
            """,
            sock_path,
        )
        msg, info = r.recv_with_info(timeout=30)
        assert msg["i"] == 0 and isinstance(info, dict)
        assert all(isinstance(v, int) for v in info.values())
        rest = list(r)  # iteration ends when every sender has gone
        assert [m["i"] for m in rest] == [1, 2, 3, 4]
        assert [m["a"].tolist() for m in rest][-1] == [0, 1, 2, 3, 4]
        out, err = prog.communicate(timeout=30)
        assert prog.returncode == 0, err


def test_iteration_waits_for_every_sender(sock_path, ctx):
    r = tq.Receiver.bind(sock_path)
    code = """
        import sys, tensor_queue as tq
        s = tq.Sender.connect(sys.argv[1], timeout=30)
        for i in range(50):
            s.send((int(sys.argv[2]), i))
        """
    progs = [program(code, sock_path, k) for k in range(3)]
    r.expect_senders(3)
    got = list(r)
    for p in progs:
        p.communicate(timeout=30)
        assert p.returncode == 0
    assert sorted(got) == sorted((k, i) for k in range(3) for i in range(50))
    r.close()


def test_closed_end_raises_closed(sock_path):
    r = tq.Receiver.bind(sock_path)
    s = tq.Sender.connect(sock_path)
    s.close()
    with pytest.raises(tq.Closed):
        s.send(1)
    r.close()
    with pytest.raises(tq.Closed):
        r.try_recv()


def test_send_to_gone_receiver_is_disconnected(sock_path):
    r = tq.Receiver.bind(sock_path)
    s = tq.Sender.connect(sock_path)
    r.close()
    del r
    with pytest.raises(tq.Disconnected):
        for _ in range(100):
            s.send(np.zeros(10))
    assert not s.is_connected()


def test_connect_to_nothing_fails_typed(sock_path):
    with pytest.raises(tq.TensorQueueError):
        tq.Sender.connect(sock_path, timeout=0.3)


def test_broadcast_to_several_receivers_and_memory_comes_back(ctx, tmp_path):
    paths = [f"/tmp/tqo-bc-{os.getpid()}-{i}" for i in range(3)]
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)
    out = ctx.Queue()
    evs = [ctx.Event() for _ in paths]
    procs = [ctx.Process(target=_workers.broadcast_receiver, args=(p, e, out)) for p, e in zip(paths, evs)]
    for p in procs:
        p.start()
    for e in evs:
        assert e.wait(60)
    senders = [tq.Sender.connect(p, timeout=30) for p in paths]
    b = tq.Broadcast(senders)
    w = np.ones(1 << 20, dtype=np.float32)
    b.send({"tag": "v1", "w": w})
    results = [out.get(timeout=60) for _ in paths]
    assert sorted(r[1:] for r in results) == [("v1", 1 << 20)] * 3
    assert b.wait_released(30)
    assert b.outstanding() == [0, 0, 0]
    for p in procs:
        p.join(30)


def test_outstanding_and_wait_released(sock_path):
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        s.send(np.zeros(1000))
        s.send(np.zeros(1000))
        a = r.recv(timeout=5)
        b = r.recv(timeout=5)
        assert s.outstanding() >= 1
        assert not s.wait_released(0.2)
        del a, b
        assert s.wait_released(10)
        assert s.outstanding() == 0


def test_memory_usage_and_trim(sock_path):
    u = tq.memory.usage()
    assert {"host_bytes", "device_bytes", "in_use_bytes"} <= set(u)
    with tq.Receiver.bind(sock_path) as r, tq.Sender.connect(sock_path) as s:
        s.send(np.zeros(4 << 20, np.uint8))
        a = r.recv(timeout=10)
        assert tq.memory.usage()["in_use_bytes"] >= 4 << 20
        del a
        assert s.wait_released(10)
    assert isinstance(tq.memory.trim(), int)
    assert tq.memory.usage()["in_use_bytes"] <= u["in_use_bytes"]


def test_doctor_runs():
    rep = tq.doctor()
    assert rep


def _free_port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


TCP_RECV = """
import sys, tensor_queue as tq
r = tq.Receiver.bind(sys.argv[1])
print("bound", flush=True)
try:
    m = r.recv(timeout=20)
    print("got", m["x"].sum(), flush=True)
except Exception as e:
    print("err", type(e).__name__, flush=True)
"""


def test_tcp_with_right_secret(monkeypatch):
    addr = f"tcp://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("TQ_SECRET", "s3cret-s3cret-s3cret")
    prog = program(TCP_RECV, addr, env={"TQ_SECRET": "s3cret-s3cret-s3cret"})
    assert prog.stdout.readline().strip() == "bound"
    s = tq.Sender.connect(addr, timeout=20)
    s.send({"x": np.arange(10)})
    out, err = prog.communicate(timeout=30)
    assert "got 45" in out, (out, err)


def test_tcp_with_wrong_secret_is_peer_refused(monkeypatch):
    addr = f"tcp://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("TQ_SECRET", "wrong-wrong-wrong-wrong")
    prog = program(TCP_RECV, addr, env={"TQ_SECRET": "s3cret-s3cret-s3cret"})
    assert prog.stdout.readline().strip() == "bound"
    with pytest.raises(ConnectionRefusedError) as ei:
        s = tq.Sender.connect(addr, timeout=5)
        s.send({"x": np.arange(10)})
    assert isinstance(ei.value, tq.PeerRefused)
    prog.kill()
    prog.communicate(timeout=30)
