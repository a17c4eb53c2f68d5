"""The Python package as a user meets it: real processes (spawn and forkserver), NumPy arrays."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time

import numpy as np
import pytest

import tensor_queue as tq
import workers
from helpers import address, connect, interrupt_program

METHODS = ["spawn", "forkserver"]


def assert_same(got, want, where="msg"):  # noqa: ANN001
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert np.array_equal(got, want), where
        assert not got.flags.writeable, f"{where}: received host memory is read-only"
    else:
        assert got == want, where


@pytest.mark.parametrize("method", METHODS)
def test_every_value_kind_crosses_processes_unchanged(method: str) -> None:
    ctx = mp.get_context(method)
    q = tq.Queue(maxsize=4)
    child = ctx.Process(target=workers.produce_every_kind, args=(q,))
    child.start()
    got = q.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0
    assert_same(got, workers.every_kind())


@pytest.mark.parametrize("method", METHODS)
def test_queue_keeps_each_producers_order(method: str) -> None:
    ctx = mp.get_context(method)
    q = tq.Queue(maxsize=8)
    children = [ctx.Process(target=workers.produce, args=(q, 50)) for _ in range(3)]
    for c in children:
        c.start()
    got = [q.get(timeout=60) for _ in range(150)]
    for c in children:
        c.join(30)
        assert c.exitcode == 0
    seen = sorted(m["i"] for m in got)
    assert seen == sorted(list(range(50)) * 3)
    assert all((m["x"] == m["i"]).all() for m in got)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)


def test_values_that_cannot_be_carried_name_where_they_sit() -> None:
    path = address()
    with tq.Receiver.bind(path) as receiver, tq.Sender.connect(path) as sender:
        cases = [
            ({"box": [1, object()]}, 'msg["box"][1]'),
            ([1, {2, 3}], "msg[1]"),
            ({"f": lambda: 0}, 'msg["f"]'),
            ({(1, frozenset([2])): 0}, "msg[(1, frozenset({2}))][1]"),
            ({"c": np.ones(2, dtype=np.complex64)}, 'msg["c"]'),
            ({"u": np.ones(2, dtype=np.uint32)}, 'msg["u"]'),
            (np.ones(3, dtype=">f4"), "msg"),
        ]
        for bad, where in cases:
            with pytest.raises(TypeError) as caught:
                sender.send(bad)
            assert isinstance(caught.value, tq.NotSendable)
            assert str(caught.value).startswith(where + " "), str(caught.value)
        loop: list = []
        loop.append(loop)
        with pytest.raises(tq.NotSendable, match="deeper"):
            sender.send(loop)
        # Nothing of the refused messages was sent; the channel goes on.
        sender.send("fine")
        assert receiver.recv(timeout=10) == "fine"
        with pytest.raises(tq.Empty):
            receiver.try_recv()


def test_exceptions_are_also_the_builtin_ones() -> None:
    assert issubclass(tq.Empty, queue.Empty)
    assert issubclass(tq.Full, queue.Full)
    assert issubclass(tq.Timeout, TimeoutError)
    assert issubclass(tq.Disconnected, EOFError)
    assert issubclass(tq.NotSendable, TypeError)
    for name in ("Disconnected", "Timeout", "ProducerFailed", "Rejected", "RouteRefused", "NotSendable", "UsedAfterFork"):
        assert issubclass(getattr(tq, name), tq.TensorQueueError)


def test_recv_timeout_info_iteration_and_context_managers() -> None:
    path = address()
    with tq.Receiver.bind(path) as receiver:
        with pytest.raises(tq.Timeout):
            receiver.recv(timeout=0.05)
        with tq.Sender.connect(path) as sender:
            assert sender.peer_pid == os.getpid()
            for i in range(3):
                sender.send((i, np.full(2, i)))
            msg, info = receiver.recv_with_info(timeout=10)
            assert msg[0] == 0 and info["seq"] == 1 and info["sender_pid"] == os.getpid()
            stages = ["sent_ns", "encoded_ns", "arrived_ns", "imported_ns", "taken_ns", "decoded_ns"]
            assert [info[k] for k in stages] == sorted(info[k] for k in stages), info
        # Iteration ends once every sender has gone and everything it sent was received.
        assert [m[0] for m in receiver] == [1, 2]
        with pytest.raises(tq.Disconnected):
            receiver.recv(timeout=1)
    with pytest.raises(tq.Closed):
        receiver.recv()


def test_arrays_forwarded_and_other_frameworks_get_array_objects() -> None:
    path = address()
    with tq.Receiver.bind(path) as receiver, tq.Sender.connect(path) as sender:
        sender.send(np.arange(6, dtype=np.int16).reshape(2, 3))
        got = receiver.recv(timeout=10)
        sender.send(got)  # a received array sent on (no copy: the same channel memory)
        again = receiver.recv(timeout=10)
        assert np.array_equal(again, got) and not again.flags.writeable
        with pytest.raises(ValueError):
            again[0, 0] = 1
        # Any DLPack consumer takes a received array.
        assert np.array_equal(np.from_dlpack(got), got)


def test_killed_producer_delivers_what_it_sent_then_disconnects() -> None:
    ctx = mp.get_context("spawn")
    path = address()
    with tq.Receiver.bind(path) as receiver:
        child = ctx.Process(target=workers.send_then_die, args=(path,))
        child.start()
        msg = receiver.recv(timeout=60)
        assert np.array_equal(msg["last"], np.arange(3))
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        with pytest.raises(tq.Disconnected):
            receiver.recv(timeout=30)


def test_killed_consumer_gives_the_memory_back() -> None:
    ctx = mp.get_context("spawn")
    path = address()
    ready = ctx.Event()
    child = ctx.Process(target=workers.hold_then_die, args=(path, ready))
    child.start()
    sender = connect(path)
    sender.send({"x": np.ones(1 << 20, dtype=np.float32)})
    assert ready.wait(60)
    assert sender.outstanding() == 1, "the consumer holds the array"
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert sender.wait_released(30), "a killed consumer's arrays come back"
    with pytest.raises(tq.Disconnected):
        for _ in range(1000):
            sender.send("anyone?", timeout=10)
            time.sleep(0.01)


@pytest.mark.parametrize("method", METHODS)
def test_ctrl_c_interrupts_a_blocked_recv(method: str) -> None:
    ctx = mp.get_context(method)
    ready = ctx.Event()
    child = ctx.Process(target=workers.block_in_recv, args=(address(), ready))
    child.start()
    assert ready.wait(60)
    time.sleep(0.2)  # into recv
    os.kill(child.pid, signal.SIGINT)
    child.join(30)
    assert child.exitcode == 42, "recv raised KeyboardInterrupt"


@pytest.mark.skipif(sys.platform != "linux", reason="fork is the Linux default being tested")
def test_a_forked_child_cannot_use_its_parents_ends_but_queues_work() -> None:
    path = address()
    receiver = tq.Receiver.bind(path)
    sender = tq.Sender.connect(path)
    q = tq.Queue()
    with pytest.raises(tq.Empty):
        q.get(timeout=0.01)  # the parent consumes
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            sender.send("from the child")
            code = 1
        except tq.UsedAfterFork as e:
            code = 2 if "fork" in str(e) else 3
        try:
            q.put("the queue opens its own end")
        except BaseException:  # noqa: BLE001
            code = 4
        os.write(w, bytes([code]))
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == bytes([2])
    os.waitpid(pid, 0)
    assert q.get(timeout=30) == "the queue opens its own end"
    sender.send("the parent's end still works")
    assert receiver.recv(timeout=10) == "the parent's end still works"


def test_a_queue_has_one_consumer_process() -> None:
    ctx = mp.get_context("spawn")
    q = tq.Queue()
    with pytest.raises(tq.Empty):
        q.get(timeout=0.05)  # this process is the consumer now
    result = ctx.Queue()
    child = ctx.Process(target=workers.consume, args=(q, result))
    child.start()
    text = result.get(timeout=60)
    child.join(30)
    assert text.startswith("NotTheConsumer"), text
    assert str(os.getpid()) in text


def test_broadcast_to_three_consumers() -> None:
    ctx = mp.get_context("spawn")
    paths = [address() for _ in range(3)]
    out = tq.Queue()
    children = [ctx.Process(target=workers.broadcast_worker, args=(p, out)) for p in paths]
    for c in children:
        c.start()
    broadcast = tq.Broadcast([connect(p) for p in paths])
    before = tq.stats()["send_copies"]
    broadcast.send({"w": np.full(1 << 16, 0.5, dtype=np.float32)})
    assert tq.stats()["send_copies"] == before + 1, "one copy for all receivers"
    got = [out.get(timeout=60) for _ in children]
    assert sorted(g["pid"] for g in got) == sorted(c.pid for c in children)
    assert all(g["sum"] == 0.5 * (1 << 16) and g["writeable"] is False for g in got)
    assert broadcast.wait_released(60)
    for c in children:
        c.join(30)
        assert c.exitcode == 0


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_100_000_messages_without_growth() -> None:
    ctx = mp.get_context("spawn")
    n = 100_000
    q = tq.Queue(maxsize=64)
    child = ctx.Process(target=workers.produce_many, args=(q, n))
    child.start()
    first = 10_000
    for i in range(first):
        assert q.get(timeout=60)[0] == i
    rss, fds = rss_kb(), len(os.listdir("/proc/self/fd"))
    for i in range(first, n):
        msg = q.get(timeout=60)
        assert msg[0] == i
    del msg
    child.join(60)
    assert child.exitcode == 0
    grown_kb = rss_kb() - rss
    assert grown_kb < 16 * 1024, f"RSS grew {grown_kb} KiB over {n - first} messages"
    assert len(os.listdir("/proc/self/fd")) <= fds, "file descriptors leaked"
    assert tq.memory.usage()["in_use_bytes"] == 0, "every received array was given back"


def test_doctor_and_memory() -> None:
    report = tq.doctor()
    assert report["channel_ok"] is True
    assert report["numpy"] == np.__version__
    x = np.ones(1 << 20, dtype=np.uint8)
    path = address()
    with tq.Receiver.bind(path) as receiver, tq.Sender.connect(path) as sender:
        sender.send(x)
        got = receiver.recv(timeout=10)
        assert tq.memory.usage()["in_use_bytes"] >= x.nbytes
        del got
        assert sender.wait_released(10)
    tq.memory.trim()
    assert tq.memory.usage()["in_use_bytes"] == 0


CLOSE_AFTER_BIG_SEND = """
import sys, tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
s.send("x" * 2_000_000, timeout=10)  # more than the socket holds: the rest waits in this process
print("sent", flush=True)
try:
    s.close()
    print("closed", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.stdout.flush()
    import os
    os._exit(0)  # the end is still open and would wait again at exit
"""


def test_ctrl_c_interrupts_close_waiting_for_a_receiver_that_never_reads():
    path = address()
    receiver = tq.Receiver.bind(path)
    try:
        # into close()'s wait (the receiver never reads)
        out, err = interrupt_program(CLOSE_AFTER_BIG_SEND, path, ready="sent")
    finally:
        receiver.close()
    assert "interrupted" in out, (out, err)


def test_stats_say_which_dlpack_path_each_array_took():
    # NumPy publishes no DLPack C exchange table: its arrays go through __dlpack__.
    path = address()
    with tq.Receiver.bind(path) as receiver, tq.Sender.connect(path) as sender:
        before = tq.stats()
        sender.send({"a": np.arange(3), "b": np.ones(2)})
        after = tq.stats()
        receiver.recv(timeout=30)
    assert after["send_dlpack_fallback"] - before["send_dlpack_fallback"] == 2, after
    assert after["send_exchange_api"] == before["send_exchange_api"], after


BROADCAST_TO_A_FULL_RECEIVER = """
import sys, tensor_queue as tq
both = tq.Broadcast([tq.Sender.connect(sys.argv[1]), tq.Sender.connect(sys.argv[2])])
both.send("first")
print("sent", flush=True)
try:
    both.send("second")  # the second receiver holds one message and never reads
    print("sent again", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_interrupts_a_broadcast_waiting_for_a_full_receiver():
    paths = [address(), address()]
    readers = [tq.Receiver.bind(paths[0]), tq.Receiver.bind(paths[1], capacity=1)]

    def first_arrived():
        assert readers[0].recv(timeout=30) == "first"

    # into the second send's wait
    out, err = interrupt_program(BROADCAST_TO_A_FULL_RECEIVER, *paths, ready="sent", before=first_arrived)
    assert "interrupted" in out, (out, err)
    # All or none: the first receiver did not get the second message either (its sender has
    # gone since: Disconnected, after everything sent was received).
    with pytest.raises((tq.Empty, tq.Disconnected)):
        readers[0].try_recv()
    for r in readers:
        r.close()


def test_broadcast_send_timeout_sends_to_nobody():
    paths = [address(), address()]
    fast, slow = tq.Receiver.bind(paths[0]), tq.Receiver.bind(paths[1], capacity=1)
    both = tq.Broadcast([tq.Sender.connect(paths[0]), tq.Sender.connect(paths[1])])
    both.send("first", timeout=30)
    assert fast.recv(timeout=30) == "first"
    with pytest.raises(tq.Timeout):
        both.send("second", timeout=0.2)
    with pytest.raises(tq.Empty):
        fast.try_recv()
    assert slow.recv(timeout=30) == "first"
    fast.close()
    slow.close()


def test_the_small_message_threshold_is_set_at_connect_and_checked() -> None:
    path = address()
    with tq.Receiver.bind(path) as receiver:
        default = tq.Sender.connect(path)
        assert default.inline_gpu_up_to == int(os.environ.get("TQ_INLINE_GPU_UP_TO", 64 << 10))
        never = tq.Sender.connect(path, inline_gpu_up_to=0)
        assert never.inline_gpu_up_to == 0  # always NCCL across hosts
        with pytest.raises(ValueError, match="inline"):
            tq.Sender.connect(path, inline_gpu_up_to=1 << 40)
        never.send({"i": 1})
        assert receiver.recv(timeout=10) == {"i": 1}
        default.close()
        never.close()


def test_route_of_a_device_this_process_does_not_have_is_a_value_error() -> None:
    path = address()
    with tq.Receiver.bind(path), tq.Sender.connect(path) as sender:
        with pytest.raises(ValueError, match="CUDA device 4096"):
            sender.route(4096)
