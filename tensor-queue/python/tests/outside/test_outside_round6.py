"""Round 6 of the outside tests: how a blocked ``recv`` / ``get`` is woken, written from the docs
only (README's Python section, ``_native.pyi``, the package docstrings). Ping-pong between two
Python programs with blocking ``recv`` (no timeout) on both sides and random short sleeps, the same
through two ``tq.Queue``s, bursts from several threads right after ``connect``, and a program
killed while the other is blocked in ``recv``. Values are NumPy-free (ints, bytes, dicts) except
where an array is the point; torch is not needed. Every wait is bounded by a watchdog: a hang is a
failure that says where it stopped."""

import multiprocessing as mp
import random
import signal
import subprocess
import threading
import time

import pytest

import tensor_queue as tq

from .conftest import program

# The other end of a ping-pong: binds argv[1], connects to argv[2], then argv[3] times waits for
# {"i": I, ...} (argv[5]: "recv", a blocking recv() with no timeout; "timeout", recv(timeout=) of
# 0-2 ms again after each Timeout; "try", try_recv() polls mixed with short waits; "spin", recv()
# after set_spin(0-50 us)), sleeps 0-200 us half the time, and answers {"i": I, "back": ...}.
# Prints "bound" once bound, "done N" at the end, then waits for stdin.
PONG = r"""
import random, sys, time
import tensor_queue as tq
here, there, count, seed, way = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rng = random.Random(seed)
r = tq.Receiver.bind(here)
if way == "spin":
    r.set_spin(rng.random() * 50e-6)
print("bound", flush=True)
s = tq.Sender.connect(there, timeout=30)

def wait():
    if way == "timeout":
        while True:
            try:
                return r.recv(timeout=rng.random() * 2e-3)  # tiny ones too (B1, fixed)
            except tq.Timeout:
                pass
    if way == "try":
        while True:
            for _ in range(rng.randrange(50)):
                try:
                    return r.try_recv()
                except tq.Empty:
                    pass
            try:
                return r.recv(timeout=1e-6 + rng.random() * 5e-4)
            except tq.Timeout:
                pass
    return r.recv()

for i in range(count):
    m = wait()
    if m["i"] != i or m["pad"] != bytes([i % 251]) * (i % 37):
        print("bad", i, repr(m)[:200], flush=True)
        sys.exit(1)
    if rng.random() < 0.5:
        time.sleep(rng.random() * 200e-6)
    s.send({"i": i, "back": [i, str(i)], "pad": bytes([i % 251]) * (i % 37)})
print("done", count, flush=True)
sys.stdin.read()
"""


def _watched(what, work, progress, stuck=40.0, on_stuck=lambda: ""):
    """Runs `work` on a thread; fails with where it stopped when `progress[0]` has not moved
    for `stuck` seconds (after calling `on_stuck`, which kills the peer so nothing hangs)."""
    out = {}

    def run():
        try:
            out["value"] = work()
        except BaseException as e:  # reported below, in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    last, since = progress[0], time.monotonic()
    while t.is_alive():
        t.join(0.2)
        if progress[0] != last:
            last, since = progress[0], time.monotonic()
        elif time.monotonic() - since > stuck:
            said = on_stuck()
            pytest.fail(f"{what}: no progress for {stuck} s, stuck at {progress[0]} (a lost wake-up?); {said}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _kill(child):
    """Kills `child` if it still runs; what it said, for a failure's message."""
    if child.poll() is None:
        child.kill()
    try:
        out, err = child.communicate(timeout=30)
    except (subprocess.TimeoutExpired, ValueError):
        return "(no output)"
    return f"stdout {(out or '')[-500:]!r} stderr {(err or '')[-2000:]!r}"


def test_ping_pong_of_20000_round_trips_with_blocking_recv_on_both_sides(sock_path):
    _ping_pong(sock_path, "recv", 20_000)


@pytest.mark.parametrize("way", ["recv", "timeout", "try", "spin"])
@pytest.mark.parametrize("env", [None, {"TQ_RINGS": "0"}], ids=["rings", "socket"])
def test_ping_pong_with_each_way_of_waiting_in_the_other_program(sock_path, way, env):
    _ping_pong(sock_path, way, 5_000, env)


def _ping_pong(sock_path, way, count, env=None):
    """`count` round trips with the PONG program waiting in `way` (its environment `env`); this
    side sends, then waits in a blocking recv() with no timeout, jitter on both sides."""
    seed = random.randrange(1 << 30)
    here, there = sock_path, sock_path + "-there"
    r = tq.Receiver.bind(here)
    child = program(PONG, there, here, count, seed, way, env=env, stdin=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "bound"
        s = tq.Sender.connect(there, timeout=30)
        rng = random.Random(seed ^ 1)
        progress = [0]

        def work():
            for i in range(count):
                if rng.random() < 0.5:
                    time.sleep(rng.random() * 200e-6)
                s.send({"i": i, "pad": bytes([i % 251]) * (i % 37)})
                m = r.recv()  # blocking, no timeout: the watchdog bounds it
                assert m["i"] == i and m["back"] == [i, str(i)], f"round trip {i}: {m!r}"
                assert m["pad"] == bytes([i % 251]) * (i % 37)
                progress[0] = i + 1

        _watched(f"ping-pong ({way}, {env}, seed {seed})", work, progress, on_stuck=lambda: _kill(child))
        assert child.stdout.readline().split() == ["done", str(count)]
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    finally:
        _kill(child)
        r.close()


def _queue_pong(q_in, q_out, count, seed):
    """A child's side of the Queue ping-pong: blocking get() (no timeout), jitter, put back."""
    rng = random.Random(seed)
    for i in range(count):
        m = q_in.get()
        assert m["i"] == i, (m, i)
        if rng.random() < 0.5:
            time.sleep(rng.random() * 200e-6)
        q_out.put({"i": i, "back": (i, b"x" * (i % 9))})


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ping_pong_through_two_queues_with_blocking_get(method):
    seed = random.randrange(1 << 30)
    count = 5_000
    there, back = tq.Queue(maxsize=4), tq.Queue(maxsize=4)
    ctx = mp.get_context(method)
    child = ctx.Process(target=_queue_pong, args=(there, back, count, seed), daemon=True)
    child.start()
    rng = random.Random(seed ^ 2)
    progress = [0]

    def work():
        for i in range(count):
            if rng.random() < 0.5:
                time.sleep(rng.random() * 200e-6)
            there.put({"i": i})
            m = back.get()  # blocking, no timeout: the watchdog bounds it
            assert m == {"i": i, "back": (i, b"x" * (i % 9))}, f"round trip {i}: {m!r}"
            progress[0] = i + 1

    try:
        _watched(f"queue ping-pong ({method}, seed {seed})", work, progress, on_stuck=lambda: child.kill() or "")
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


# Argv: path, threads, count. Each thread connects its own Sender and sends `count` messages at
# once (no wait after connect), all threads released together; the program then returns.
BURST = r"""
import sys, threading
import numpy as np
import tensor_queue as tq
path, threads, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
go = threading.Barrier(threads)
failed = []
def run(t):
    try:
        s = tq.Sender.connect(path, timeout=30)
        go.wait()
        for i in range(count):
            if i % 5 == 0:
                s.send({"t": t, "i": i, "a": np.full(7, i, dtype=np.int32)})
            else:
                s.send({"t": t, "i": i, "b": bytes([i % 251]) * 11})
    except BaseException as e:
        failed.append(f"thread {t}: {e!r}")
ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
print("failed", failed, flush=True) if failed else print("done", flush=True)
"""


@pytest.mark.parametrize("blocked", [True, False], ids=["blocked-before", "reading-late"])
def test_a_burst_from_threads_right_after_connect_arrives_whole_in_per_sender_order(sock_path, blocked):
    threads, count = 6, 1500
    r = tq.Receiver.bind(sock_path, capacity=8)
    r.expect_senders(threads)
    progress = [0]
    nxt = [0] * threads
    started = threading.Event()

    def work():
        if not blocked:
            started.wait(60)
        while True:
            try:
                m = r.recv()  # blocked before the burst starts (or from late on)
            except tq.Disconnected:
                return
            t, i = m["t"], m["i"]
            assert i == nxt[t], f"sender {t}: got {i}, expected {nxt[t]}"
            if i % 5 == 0:
                assert m["a"].tolist() == [i] * 7
            else:
                assert m["b"] == bytes([i % 251]) * 11
            nxt[t] += 1
            progress[0] += 1

    child = program(BURST, sock_path, threads, count)
    try:
        if not blocked:
            time.sleep(1.0)  # the senders wait for credits meanwhile
            started.set()
        _watched("a burst after connect", work, progress, on_stuck=lambda: _kill(child))
        assert nxt == [count] * threads, nxt
        out, err = child.communicate(timeout=60)
        assert out.strip() == "done", (out, err[-2000:])
        assert child.returncode == 0
        assert r.take_errors() == []
    finally:
        _kill(child)
        r.close()


# Connects, sends argv[2] messages, prints "sent", then sleeps until killed.
QUIET = r"""
import sys, time
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
for i in range(int(sys.argv[2])):
    s.send({"i": i, "b": b"q" * i})
print("sent", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("with_timeout", [False, True], ids=["recv", "recv-timeout"])
def test_a_program_killed_while_the_receiver_is_blocked_in_recv_wakes_it_with_the_end(sock_path, with_timeout):
    r = tq.Receiver.bind(sock_path)
    r.expect_senders(1)
    child = program(QUIET, sock_path, 3)
    try:
        assert child.stdout.readline().strip() == "sent"
        for i in range(3):
            assert r.recv(timeout=30) == {"i": i, "b": b"q" * i}
        result = {}

        def blocked():
            try:
                result["got"] = r.recv(timeout=300) if with_timeout else r.recv()
            except BaseException as e:
                result["error"] = e

        t = threading.Thread(target=blocked, daemon=True)
        t.start()
        t.join(0.5)
        assert t.is_alive(), f"recv returned while the sender was quiet: {result}"
        child.send_signal(signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the blocked recv did not wake within 30 s of the sender's SIGKILL"
        assert isinstance(result.get("error"), tq.Disconnected), result
        assert isinstance(result["error"], EOFError)
    finally:
        _kill(child)
        r.close()


def test_a_program_killed_while_recv_is_blocked_leaves_the_other_sender_served(sock_path):
    # A receiver with two sender programs, one SIGKILLed while recv is blocked with nothing to
    # read: recv must not end, and must wake for the other's message, then the end.
    r = tq.Receiver.bind(sock_path)
    r.expect_senders(2)
    doomed = program(QUIET, sock_path, 2)
    stays = program(
        r"""
import sys
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
print("ready", flush=True)
sys.stdin.readline()
s.send({"i": 99, "b": b"last"})
print("sent", flush=True)
""",
        sock_path,
        stdin=subprocess.PIPE,
    )
    try:
        assert doomed.stdout.readline().strip() == "sent"
        assert stays.stdout.readline().strip() == "ready"
        assert [r.recv(timeout=30)["i"] for _ in range(2)] == [0, 1]
        result = []

        def blocked():
            while True:
                try:
                    result.append(r.recv())
                except BaseException as e:
                    result.append(e)
                    return

        t = threading.Thread(target=blocked, daemon=True)
        t.start()
        time.sleep(0.3)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(30)
        time.sleep(0.5)
        assert result == [], f"recv ended or got something when one of two senders was killed: {result}"
        stays.stdin.write("go\n")
        stays.stdin.flush()
        assert stays.stdout.readline().strip() == "sent"
        t.join(30)
        assert not t.is_alive(), f"recv did not wake for the other sender's message and end: {result}"
        assert result[0] == {"i": 99, "b": b"last"}, result
        assert isinstance(result[1], tq.Disconnected), result
    finally:
        _kill(doomed)
        _kill(stays)
        r.close()


# Outside round 6, B1 (fixed): a timeout under about 50 ns raised Empty (try_recv's exception).
@pytest.mark.parametrize("timeout", [0.0, 1e-9, 1e-8])
def test_recv_with_a_tiny_timeout_and_nothing_waiting_raises_timeout(sock_path, timeout):
    r = tq.Receiver.bind(sock_path)
    s = tq.Sender.connect(sock_path, timeout=30)
    try:
        for _ in range(20):
            with pytest.raises(tq.Timeout):
                r.recv(timeout=timeout)
    finally:
        s.close()
        r.close()


# Sends argv[2] messages of argv[3] small arrays each (`_many_arrays`, whose source is put before
# this), then prints "sent" and waits for stdin to close.
MANY = r"""
import sys
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
for i in range(int(sys.argv[2])):
    s.send({"i": i, "arrays": _many_arrays(i, int(sys.argv[3]))})
print("sent", flush=True)
sys.stdin.read()
"""


def _many_arrays(i, n):
    """`n` small arrays for message `i`: views of one buffer at regular offsets, every dtype the
    package lists in turn, empty ones, and strided views (every other element, a transposed
    block, a reversed row)."""
    import numpy as np

    base = (np.arange(n * 8, dtype=np.float32) * 0.5 + i).reshape(n, 8)
    dtypes = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64]
    out = []
    for k in range(n):
        kind = k % 6
        if kind == 0:
            out.append(base[k])  # a row of one buffer
        elif kind == 1:
            dt = dtypes[(k // 6) % len(dtypes)]
            out.append((np.arange(k % 7 + 1) + i + k).astype(dt))
        elif kind == 2:
            out.append(np.zeros((k % 3, 0), dtype=np.int32))  # no element
        elif kind == 3:
            out.append(base[k, ::2])  # stride 2
        elif kind == 4:
            out.append(base[max(k - 2, 0) : k + 1, 1:4].T)  # transposed block
        else:
            out.append(base[k, ::-1])  # negative stride
    return out


def _check_many(m, n):
    import numpy as np

    want = _many_arrays(m["i"], n)
    got = m["arrays"]
    assert len(got) == n, f"message {m['i']}: {len(got)} arrays"
    for k, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape, f"message {m['i']} array {k}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        assert np.array_equal(g, w), f"message {m['i']} array {k}: values"


@pytest.mark.parametrize("n,count", [(1024, 30), (4096, 10)])
def test_messages_of_thousands_of_small_arrays_from_another_program_held_at_once_arrive_exact(sock_path, n, count):
    import inspect

    r = tq.Receiver.bind(sock_path, capacity=count)
    r.expect_senders(1)
    code = "import numpy as np\n" + inspect.getsource(_many_arrays) + MANY
    child = program(code, sock_path, count, n, stdin=subprocess.PIPE)
    try:
        progress = [0]
        held = []

        def work():
            while len(held) < count:
                held.append(r.recv())
                progress[0] += 1

        _watched(f"{count} messages of {n} arrays", work, progress, on_stuck=lambda: _kill(child))
        assert [m["i"] for m in held] == list(range(count))
        for m in held:
            _check_many(m, n)
        assert child.stdout.readline().strip() == "sent"
        child.stdin.close()
        assert child.wait(timeout=60) == 0
        with pytest.raises(tq.Disconnected):
            r.recv(timeout=30)
    finally:
        _kill(child)
        r.close()
