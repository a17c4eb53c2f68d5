"""Round 9 of the outside tests, from the Python side: what an outside tester found with only the
README and the package's stubs, as tests of the installed package (the `tq.Queue` findings are in
``test_outside_round9_queue.py``). Every wait is bounded; no bound is a speed assertion."""

import gc
import multiprocessing as mp
import pytest

import helpers
import tensor_queue as tq

np = pytest.importorskip("numpy")

FEEDER = r"""
import sys, time
import numpy as np
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
for i in range(5):
    s.send((i, np.full(100000, i)))
print("sent", flush=True)
sys.stdin.readline()  # the test's word: its fork child has exited
print("outstanding", s.outstanding(), flush=True)
for i in range(5, 40):
    s.send((i, np.full(100000, i)), timeout=30)
s.close()
print("done", flush=True)
"""


def _drop_inherited(held):
    held.clear()
    gc.collect()


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs the fork start method")
def test_a_fork_child_dropping_inherited_arrays_costs_the_parent_nothing():
    # Was: the child's drops released the parent's messages over the parent's connection; the
    # sender saw 0 outstanding while the parent held 5, then the connection broke and the parent
    # saw a clean end after 2 of 35 further messages.
    path = helpers.address("round9-fork")
    with tq.Receiver.bind(path) as r:
        with helpers.running(FEEDER, path) as feeder:
            held = [r.recv(timeout=30) for _ in range(5)]
            assert helpers.line_of(feeder, 30) == "sent"
            child = mp.get_context("fork").Process(target=_drop_inherited, args=(held,))
            child.start()
            child.join(30)
            assert child.exitcode == 0, child.exitcode
            feeder.stdin.write("go\n")
            feeder.stdin.flush()
            assert helpers.line_of(feeder, 30) == "outstanding 5", "the parent still holds its 5 messages"
            got = [int(m[0]) for m in held]
            for _ in range(35):
                message = r.recv(timeout=30)
                assert (message[1] == message[0]).all()
                got.append(int(message[0]))
            assert got == list(range(40))
            assert all((m[1] == m[0]).all() for m in held), "a held array changed"
            assert helpers.line_of(feeder, 30) == "done"
            with pytest.raises(tq.Disconnected):
                r.recv(timeout=30)
            assert r.take_errors() == []


RECEIVER_THAT_WAITS = r"""
import sys
import tensor_queue as tq
r = tq.Receiver.bind(sys.argv[1], capacity=1)
print("bound", flush=True)
sys.stdin.readline()  # reads nothing until the test says so
got = []
while True:
    try:
        got.append(r.recv(timeout=30))
    except tq.Disconnected:
        break
print("got", got, flush=True)
"""


def test_close_from_another_thread_ends_a_send_waiting_for_room_with_closed():
    # Was: the waiting send went on (on a clone of the end), and sent its message once the
    # receiver read, after close() had returned; with a receiver that never reads, for ever.
    import threading

    path = helpers.address("round9-close")
    with helpers.running(RECEIVER_THAT_WAITS, path) as receiver:
        assert helpers.line_of(receiver, 30) == "bound"
        s = tq.Sender.connect(path, timeout=30)
        s.send("m0", timeout=30)  # the one credit
        outcome = []

        def waiting_send():
            try:
                s.send("m1")
                outcome.append("sent")
            except tq.TensorQueueError as error:
                outcome.append(error)

        thread = threading.Thread(target=waiting_send, daemon=True)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "the send waits for room"
        s.close()
        thread.join(30)
        assert not thread.is_alive(), "close() did not end the waiting send"
        assert len(outcome) == 1 and isinstance(outcome[0], tq.Closed), outcome
        receiver.stdin.write("read\n")
        receiver.stdin.flush()
        assert helpers.line_of(receiver, 60) == "got ['m0']", "nothing is sent after close()"


ITERATING_RECEIVER = r"""
import sys
import tensor_queue as tq
r = tq.Receiver.bind(sys.argv[1])
print("bound", flush=True)
print("ended after", sum(1 for _ in r), flush=True)
"""


def test_a_closed_broadcast_lets_go_of_its_senders():
    # Was: Broadcast had no close(): with every Sender closed, it kept their connections open
    # and the receiver's `for` loop waited until the Broadcast was garbage-collected.
    path = helpers.address("round9-broadcast")
    with helpers.running(ITERATING_RECEIVER, path) as receiver:
        assert helpers.line_of(receiver, 30) == "bound"
        s = tq.Sender.connect(path, timeout=30)
        with tq.Broadcast([s]) as broadcast:
            broadcast.send({"x": np.ones(3)}, timeout=30)
            s.close()
        with pytest.raises(tq.Closed):
            broadcast.send("after", timeout=1)
        assert helpers.line_of(receiver, 30) == "ended after 1"


def test_a_full_queue_refuses_try_send_and_send_with_no_wait_before_copying(tmp_path):
    # Was: each refused try copied the whole message into channel memory first (166 ms for 256
    # MiB), however full the queue.
    big = np.ones(4 << 20, dtype=np.float32)
    with tq.Receiver.bind(str(tmp_path / "full.sock"), capacity=1) as r, tq.Sender.connect(r.address) as s:
        s.send("fills the queue", timeout=30)
        before = tq.stats()["send_copy_bytes"]
        for _ in range(20):
            with pytest.raises(tq.Full):
                s.try_send({"x": big})
            with pytest.raises(tq.Timeout):
                s.send({"x": big}, timeout=0)
        with tq.Broadcast([s]) as broadcast:
            with pytest.raises(tq.Timeout):
                broadcast.send({"x": big}, timeout=0)
        with pytest.raises(tq.InvalidArgument):
            s.send({"x": big}, timeout=-1)
        assert tq.stats()["send_copy_bytes"] == before, "refused sends copied the message"
        assert r.recv(timeout=30) == "fills the queue"
        s.send({"x": big}, timeout=30)
        assert (r.recv(timeout=30)["x"] == 1).all()


LOW_ON_DESCRIPTORS = r"""
import os, resource, sys
import numpy as np
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
s.send("first", timeout=30)  # the connection's own descriptors are open now
spare = len(os.listdir("/proc/self/fd")) + 4
resource.setrlimit(resource.RLIMIT_NOFILE, (spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
for i in range(12):  # the receiver holds each: every array needs a chunk (a descriptor) of its own
    try:
        s.send({"i": i, "x": np.full((65 << 20) // 8, i, dtype=np.int64)}, timeout=30)
    except tq.TensorQueueError as error:
        print("raised", type(error).__name__, isinstance(error, TypeError), error, flush=True)
        break
else:
    print("never ran out", flush=True)
s.send("last", timeout=30)
s.close()
print("done", flush=True)
"""


def test_a_sender_out_of_descriptors_raises_the_channels_error_not_not_sendable():
    # Was: NotSendable (a TypeError) "msg["x"] memfd_create failed: Too many open files": the
    # array was fine; the process was out of descriptors for a moment.
    path = helpers.address("round9-nofile")
    with tq.Receiver.bind(path) as r:
        with helpers.running(LOW_ON_DESCRIPTORS, path) as sender:
            held = [r.recv(timeout=60)]
            while not (isinstance(held[-1], str) and held[-1] == "last"):
                held.append(r.recv(timeout=60))
            line = helpers.line_of(sender, 60)
            assert line.startswith("raised "), line
            name, is_type_error = line.split()[1:3]
            assert name != "NotSendable" and is_type_error == "False", line
            assert "open files" in line or "descriptor" in line, line
            assert helpers.line_of(sender, 60) == "done"


class _UserArray(np.ndarray):
    """A NumPy subclass defined outside NumPy."""


def test_a_numpy_subclass_of_the_users_own_is_refused_as_numpys_are(tmp_path):
    # Was: accepted (its type's module says nothing of NumPy), arriving as tensor_queue.Array.
    with tq.Receiver.bind(str(tmp_path / "sub.sock")) as r, tq.Sender.connect(r.address) as s:
        with pytest.raises(tq.NotSendable, match="subclass of numpy.ndarray"):
            s.send({"x": np.arange(3.0).view(_UserArray)})
        s.send({"x": np.asarray(np.arange(3.0).view(_UserArray))})
        got = r.recv(timeout=30)["x"]
        assert type(got) is np.ndarray and list(got) == [0.0, 1.0, 2.0]


def test_counts_out_of_range_are_invalid_arguments(tmp_path):
    # Was: capacity=0 accepted (the error for -1 said "from 1"), expect_senders(-1) a bare
    # OverflowError.
    for bad in (0, -1, 1 << 40):
        with pytest.raises(tq.InvalidArgument, match="from 1"):
            tq.Receiver.bind(str(tmp_path / f"cap{bad}.sock"), capacity=bad)
    with tq.Receiver.bind(str(tmp_path / "expect.sock")) as r:
        with pytest.raises(tq.InvalidArgument, match="0 or more"):
            r.expect_senders(-1)
        r.expect_senders(0)  # no sender will come: the end is definite at once
        with pytest.raises(tq.Disconnected):
            r.recv(timeout=10)
