"""Round 7 of the outside tests, from the Python side: channels across "hosts" (``tcp://``
addresses on 127.0.0.1, the secret in ``TQ_SECRET``) carrying NumPy arrays as a demanding user
sends them, written from the README and the package's docstrings only. Several senders per
process (threads) and several programs into one receiver, array sizes from 0 bytes to 64 MiB
mixed in one stream, every byte and each sender's order checked; a consumer holding hundreds of
messages while more arrive; a consumer that stops reading (``Timeout``, ``Full``, then everything
once); a sender program SIGKILLed right after ``send`` returned, and after ``close()``; a receiver
program SIGKILLed while threads send to it; raw sockets that stall or lie beside honest senders;
non-contiguous, offset, 0-size and broadcast arrays of every listed dtype in one message.
Every wait is bounded: a hang is a failure that says where it stopped, never a hung run. No
bound is a speed assertion."""

import os
import signal
import socket
import sys
import threading
import time

import numpy as np
import pytest

import helpers
import tensor_queue as tq

SECRET = "outside-round7-python-secret-0123456789abcdef"
SIZES = [0, 1, 13, 4096, 65539, 1 << 20, (4 << 20) + 7, 64 << 20]

# What every program of this file shares with this one: the message `i` of sender `s` (a dict of
# a payload of `SIZES[...]` random bytes that only (s, i) makes, a few float32 numbers naming it,
# and an empty int64 array) and its check.
COMMON = r"""
import numpy as np
SIZES = [0, 1, 13, 4096, 65539, 1 << 20, (4 << 20) + 7, 64 << 20]

def size_of(s, i, top):
    if i == 3:
        return SIZES[top]
    return SIZES[(s * 7919 + i * 104729 + (i * i) % 13) % (top + 1)]

def message(s, i, top):
    n = size_of(s, i, top)
    x = np.random.default_rng([s, i]).integers(0, 256, n, dtype=np.uint8)
    f = np.array([s * 1000 + i + k * 0.5 for k in range(i % 5)], dtype=np.float32)
    return {"s": s, "i": i, "x": x, "f": f, "e": np.zeros((0, 3), dtype=np.int64)}

def problem(m, top):
    want = message(m["s"], m["i"], top)
    for key in ("x", "f", "e"):
        a, b = m[key], want[key]
        if not isinstance(a, np.ndarray) or a.dtype != b.dtype or a.shape != b.shape:
            return f"sender {m['s']} message {m['i']} {key}: {type(a).__name__} {getattr(a, 'dtype', None)} {getattr(a, 'shape', None)}"
        if not np.array_equal(a, b):
            return f"sender {m['s']} message {m['i']} {key}: bytes differ"
    return None
"""
exec(COMMON)  # noqa: S102 - the same definitions here as in the programs

# A sender program: argv = address, first id, threads, count, top, end. Each thread connects its
# own Sender and sends `count` messages; prints "sent-all"; then `end`: "wait" (close() every
# sender, print "closed", wait for stdin), "die" (SIGKILL itself at once), "closed-die" (close(),
# print "closed", SIGKILL).
SENDER = COMMON + r"""
import os, signal, sys, threading
import tensor_queue as tq
addr, first, threads, count, top, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
senders = [tq.Sender.connect(addr, timeout=60) for _ in range(threads)]
failed = []
def feed(t):
    try:
        for i in range(count):
            senders[t].send(message(first + t, i, top))
    except BaseException as e:
        failed.append(repr(e))
workers = [threading.Thread(target=feed, args=(t,)) for t in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
if failed:
    print("failed", failed, flush=True)
    sys.exit(1)
print("sent-all", flush=True)
if end == "die":
    os.kill(os.getpid(), signal.SIGKILL)
for s in senders:
    s.close()
print("closed", flush=True)
if end == "closed-die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()
"""

# A receiver program: binds tcp://127.0.0.1:0, prints "address A", then receives and checks
# messages forever ("got S I" or "bad WHY").
RECEIVER = COMMON + r"""
import sys
import tensor_queue as tq
r = tq.Receiver.bind("tcp://127.0.0.1:0", capacity=4)
print("address", r.address, flush=True)
while True:
    m = r.recv()
    why = problem(m, 7)
    print("bad", why if why else f"got {m['s']} {m['i']}", flush=True)
"""

# A program that connects with whatever TQ_SECRET it was given and says how that went.
CONNECT = r"""
import sys
import tensor_queue as tq
try:
    s = tq.Sender.connect(sys.argv[1], timeout=30)
    s.send({"who": "impostor"}, timeout=10)
    print("connected", flush=True)
except tq.TensorQueueError as e:
    print("refused", type(e).__name__, [c.__name__ for c in type(e).__mro__], flush=True)
except Exception as e:
    print("other", type(e).__name__, e, flush=True)
sys.stdin.read()
"""


def program(code, *args, secret=SECRET):
    return helpers.program(code, *args, env={"TQ_SECRET": secret})


def line_of(prog, bound=120.0):
    return helpers.line_of(prog, bound)


def until(prog, prefix, bound=120.0):
    while True:
        line = line_of(prog, bound)
        if not line:
            prog.kill()
            pytest.fail(f"the program ended before saying {prefix!r}: {prog.communicate()[1][-2000:]}")
        if line.startswith(prefix):
            return line[len(prefix) :].strip()


def end(prog):
    if prog.poll() is None:
        prog.kill()
    prog.wait(timeout=30)
    for f in (prog.stdin, prog.stdout, prog.stderr):
        f.close()


def within(bound, what, work):
    """Runs `work` on a thread; its value, or a failure saying `what` did not end in `bound`."""
    out = {}

    def run():
        try:
            out["value"] = work()
        except BaseException as e:  # raised again below, in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    if t.is_alive():
        pytest.fail(f"{what} did not return within {bound} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("TQ_SECRET", SECRET)


def bind(capacity):
    r = tq.Receiver.bind("tcp://127.0.0.1:0", capacity=capacity)
    assert r.address.startswith("tcp://127.0.0.1:") and not r.address.endswith(":0"), r.address
    return r


def receive_streams(r, want, top):
    """Receives until every sender of `want` ({id: count}) delivered all, each checked, in order."""

    def work():
        nxt = {s: 0 for s in want}
        for n in range(sum(want.values())):
            m = r.recv(timeout=120)
            assert m["s"] in nxt, f"a message of unknown sender {m['s']}"
            assert m["i"] == nxt[m["s"]], f"sender {m['s']}: {m['i']} came where {nxt[m['s']]} was due"
            nxt[m["s"]] += 1
            why = problem(m, top)
            assert why is None, why
        return nxt

    got = within(400, "receiving the mixed streams", work)
    assert got == want


def test_tcp_threads_and_programs_mixed_sizes_arrive_exact_in_order(secret_env):
    r = bind(8)
    count = 10
    progs = [program(SENDER, r.address, first, 2, count, 7, "wait") for first in (10, 20)]
    try:
        senders = [tq.Sender.connect(r.address, timeout=60) for _ in range(2)]
        failed = []

        def feed(t):
            try:
                for i in range(count):
                    senders[t].send(message(t, i, 7), timeout=120)
            except BaseException as e:
                failed.append(e)

        threads = [threading.Thread(target=feed, args=(t,), daemon=True) for t in range(2)]
        for t in threads:
            t.start()
        receive_streams(r, {s: count for s in (0, 1, 10, 11, 20, 21)}, 7)
        for t in threads:
            t.join(60)
        assert not failed, failed
        for p in progs:
            assert until(p, "closed") == ""
        for s in senders:
            within(60, "close()", s.close)
        for p in progs:
            p.stdin.close()
            assert p.wait(timeout=60) == 0
        # Nothing more comes: Empty, or Disconnected now that every sender has gone.
        with pytest.raises((tq.Empty, tq.Disconnected)):
            r.try_recv()
    finally:
        for p in progs:
            end(p)
        r.close()


def test_tcp_consumer_holding_hundreds_while_more_arrive_finds_them_unaltered(secret_env):
    r = bind(16)
    count = 120
    progs = [program(SENDER, r.address, first, 2, count, 5, "closed-die") for first in (30, 40)]
    try:

        def work():
            held = []
            for n in range(4 * count):
                held.append(r.recv(timeout=120))
                if n % 97 == 0:
                    for old in held[:20]:
                        assert problem(old, 5) is None, "a held message changed while more arrived"
            return held

        held = within(300, "receiving and holding 480 messages", work)
        for p in progs:
            until(p, "closed")
            assert p.wait(timeout=60) == -signal.SIGKILL
        # Their programs are gone; what this consumer holds is still what they sent, read-only.
        nxt = {}
        for m in held:
            assert m["i"] == nxt.get(m["s"], 0), f"sender {m['s']}: order"
            nxt[m["s"]] = m["i"] + 1
            assert problem(m, 5) is None
        assert sorted(nxt.values()) == [count] * 4
        with pytest.raises(tq.Disconnected):
            within(120, "recv after every sender died", lambda: r.recv(timeout=60))
    finally:
        for p in progs:
            end(p)
        r.close()


def test_tcp_consumer_that_stops_reading_gives_timeout_and_full_then_everything_once(secret_env):
    r = bind(4)
    try:
        senders = [tq.Sender.connect(r.address, timeout=60) for _ in range(2)]
        accepted = {}

        def fill(t):
            i = 0
            while True:
                try:
                    senders[t].send(message(t, i, 7), timeout=0.5)
                except tq.Timeout:
                    break
                i += 1
                assert i < 10_000, "10,000 accepted by a receiver that does not read"
            with pytest.raises(tq.Full):
                senders[t].try_send(message(t, i, 7))
            accepted[t] = i

        threads = [threading.Thread(target=fill, args=(t,), daemon=True) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a send with a timeout, or try_send, to a full queue hung"
        assert set(accepted) == {0, 1}, "a filling thread failed"
        receive_streams(r, accepted, 7)
        with pytest.raises(tq.Timeout):
            r.recv(timeout=0.5)
        for t, s in enumerate(senders):
            s.send(message(t, accepted[t], 7), timeout=60)
            m = r.recv(timeout=120)
            assert (m["s"], m["i"]) == (t, accepted[t]) and problem(m, 7) is None
            within(60, "close()", s.close)
    finally:
        r.close()


@pytest.mark.parametrize("end_how", ["die", "closed-die"])
def test_tcp_sender_program_sigkilled_after_sending_delivers_whole_prefixes(secret_env, end_how):
    r = bind(8)
    count = 15
    got = {}
    problems = []

    def work():
        while True:
            try:
                m = r.recv()  # no timeout: the sender's death must end it (bounded by join below)
            except tq.Disconnected:
                return "end"
            except BaseException as e:
                return repr(e)
            if m["i"] != got.get(m["s"], 0):
                problems.append(f"sender {m['s']}: {m['i']} where {got.get(m['s'], 0)} was due")
            got[m["s"]] = m["i"] + 1
            why = problem(m, 7)
            if why:
                problems.append(why)

    reader = threading.Thread(target=lambda: problems.append(work()), daemon=True)
    reader.start()
    p = program(SENDER, r.address, 60, 3, count, 7, end_how)
    try:
        assert p.wait(timeout=300) == -signal.SIGKILL
        reader.join(200)
        assert not reader.is_alive(), "recv hung after the sender was killed"
        assert problems[-1] == "end", problems
        assert problems[:-1] == [], problems
        if end_how == "closed-die":
            assert got == {60: count, 61: count, 62: count}, "messages closed() said were written got lost"
        assert set(got) <= {60, 61, 62}
    finally:
        end(p)
        r.close()


def test_tcp_receiver_program_killed_while_threads_send_raises_disconnected(secret_env):
    p = program(RECEIVER)
    try:
        address = until(p, "address")
        senders = [tq.Sender.connect(address, timeout=60) for _ in range(3)]
        results = {}
        progress = threading.Semaphore(0)

        def feed(t):
            i = 0
            try:
                while i < 100_000:
                    senders[t].send(message(t, i, 7))  # no timeout: must not wait forever
                    i += 1
                    progress.release()
            except BaseException as e:
                results[t] = (i, e)

        threads = [threading.Thread(target=feed, args=(t,), daemon=True) for t in range(3)]
        for t in threads:
            t.start()
        for _ in range(8):
            assert progress.acquire(timeout=120), "the senders made no progress"
        os.kill(p.pid, signal.SIGKILL)
        for t in threads:
            t.join(200)
            assert not t.is_alive(), "a send to a killed receiver hung"
        for t in range(3):
            i, e = results[t]
            assert isinstance(e, tq.Disconnected) and isinstance(e, EOFError), f"sender {t} after {i}: {e!r}"
            assert not senders[t].is_connected()
            within(90, "close() of a sender whose receiver was killed", senders[t].close)
        out = p.stdout.read()
        assert "bad" not in out.replace("bad got", ""), out[-2000:]
    finally:
        end(p)


def test_tcp_received_arrays_are_the_receivers_own_and_writeable_as_the_readme_says(secret_env):
    # B1 of this round: the README said every received array is read-only; over TCP the bytes
    # land in the receiver's own memory, and the README now says they arrive writeable. Writing
    # one changes neither the sender's array nor another received message.
    r = bind(4)
    try:
        with tq.Sender.connect(r.address, timeout=60) as s:
            sent = np.arange(10, dtype=np.uint8)
            s.send({"small": sent, "big": np.arange(1 << 20, dtype=np.int32)})
            s.send({"small": sent, "big": np.arange(1 << 20, dtype=np.int32)})
            m = within(60, "recv", lambda: r.recv(timeout=60))
            other = within(60, "recv", lambda: r.recv(timeout=60))
        assert m["small"].tolist() == list(range(10)) and m["big"][-1] == (1 << 20) - 1
        assert m["small"].flags.writeable and m["big"].flags.writeable
        m["small"][:] = 7
        m["big"][:] = -1
        assert sent.tolist() == list(range(10)), "the sender's array changed"
        assert other["small"].tolist() == list(range(10)) and other["big"][-1] == (1 << 20) - 1
    finally:
        r.close()


def _closed_by_peer(sock, bound):
    sock.settimeout(0.2)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            if not sock.recv(4096):
                return True
        except TimeoutError:
            pass
        except OSError:
            return True
    return False


def test_tcp_silent_lying_and_wrong_secret_peers_cost_honest_streams_nothing(secret_env):
    r = bind(8)
    host, port = "127.0.0.1", int(r.address.rsplit(":", 1)[1])
    silent = [socket.create_connection((host, port), timeout=10) for _ in range(40)]
    stalled = []
    for _ in range(6):
        c = socket.create_connection((host, port), timeout=10)
        c.sendall(b"tq-auth-v1\x00\x00")
        stalled.append(c)
    liars = []
    for k in range(3):
        c = socket.create_connection((host, port), timeout=10)
        try:
            c.sendall(np.random.default_rng(k).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
        except OSError:
            pass
        liars.append(c)
    impostor = program(CONNECT, r.address, secret="a-wrong-secret-of-the-right-length-0000000")
    honest = program(SENDER, r.address, 70, 2, 8, 7, "wait")
    try:
        s = tq.Sender.connect(r.address, timeout=60)
        feeder = threading.Thread(target=lambda: [s.send(message(5, i, 7), timeout=120) for i in range(8)], daemon=True)
        feeder.start()
        receive_streams(r, {5: 8, 70: 8, 71: 8}, 7)
        feeder.join(60)
        until(honest, "closed")
        said = line_of(impostor)
        assert said.startswith("refused"), f"a sender with the wrong secret: {said}"
        for c in silent + stalled + liars:
            assert _closed_by_peer(c, 40), "a connection that never proved the secret was kept past 40 s"
            c.close()
        within(60, "close()", s.close)
    finally:
        for p in (impostor, honest):
            end(p)
        r.close()


def _views():
    """Arrays of every listed dtype, most of them views that are not contiguous, with offsets."""
    base = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    out = {
        "f32 transposed": base.T,
        "f32 column window": base[:, 40:45],
        "f32 every 3rd row reversed": base[::-3],
        "f32 nothing": base[63:63],
        "f64 0-d": np.array(1 / 3),
        "i64 strided": (np.arange(1000, dtype=np.int64) * 7 - 3000)[3::7],
        "i32 flipped 2-d": np.arange(30, dtype=np.int32).reshape(5, 6)[::-1, ::-1],
        "i16 broadcast": np.broadcast_to(np.arange(5, dtype=np.int16) * 1000 - 15000, (3, 5)),
        "i8 permuted": np.arange(-60, 60, dtype=np.int8).reshape(2, 3, 4, 5).transpose(3, 1, 0, 2),
        "u8 offset": np.arange(256, dtype=np.uint8)[200:],
        "bool pattern": (np.arange(100) % 3 == 0)[1::2],
        "f16 halves": (np.arange(24, dtype=np.float16) * 0.25).reshape(2, 3, 4)[:, ::2, 1:],
        "empty 3-d": np.zeros((2, 0, 7), dtype=np.uint8),
        "u8 64 MiB transposed": np.random.default_rng(7).integers(0, 256, (8192, 8192), dtype=np.uint8).T,
    }
    return out


def test_tcp_views_of_every_dtype_in_one_message_arrive_exact(secret_env):
    r = bind(4)
    try:
        want = _views()
        with tq.Sender.connect(r.address, timeout=60) as s:
            for k in range(2):
                s.send({"k": k, "views": want, "after": np.arange(k + 3)}, timeout=120)
                m = within(120, "recv of the views", lambda: r.recv(timeout=120))
                assert m["k"] == k and m["after"].tolist() == list(range(k + 3))
                assert set(m["views"]) == set(want)
                for name, a in want.items():
                    b = m["views"][name]
                    assert isinstance(b, np.ndarray), name
                    assert b.dtype == a.dtype and b.shape == np.shape(a), f"{name}: {b.dtype} {b.shape}"
                    assert np.array_equal(b, a), f"{name}: values"
    finally:
        r.close()


def test_tcp_one_sender_shared_by_eight_threads_keeps_each_threads_order_exact(secret_env):
    r = bind(8)
    try:
        s = tq.Sender.connect(r.address, timeout=60)
        count = 40
        failed = []

        def feed(t):
            try:
                for i in range(count):
                    m = message(t, i, 6)
                    if i % 2:
                        s.send(m, timeout=120)
                    else:
                        while True:
                            try:
                                s.try_send(m)
                                break
                            except tq.Full:
                                time.sleep(0.0002)
            except BaseException as e:
                failed.append((t, e))

        threads = [threading.Thread(target=feed, args=(t,), daemon=True) for t in range(8)]
        for t in threads:
            t.start()
        receive_streams(r, {t: count for t in range(8)}, 6)
        for t in threads:
            t.join(60)
        assert not failed, failed
        within(60, "close()", s.close)
        with pytest.raises(tq.Disconnected):
            r.recv(timeout=60)
    finally:
        r.close()


def test_tcp_hundreds_of_threads_connecting_at_once_all_get_in(secret_env):
    r = bind(8)
    try:
        for burst in range(3):
            n = 300
            barrier = threading.Barrier(n)
            results = {}

            def go(k):
                barrier.wait()
                try:
                    s = tq.Sender.connect(r.address, timeout=60)
                    s.send({"burst": burst, "k": k}, timeout=60)
                    results[k] = s
                except BaseException as e:
                    results[k] = e

            threads = [threading.Thread(target=go, args=(k,), daemon=True) for k in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
                assert not t.is_alive(), "a connect hung"
            refused = {k: v for k, v in results.items() if isinstance(v, BaseException)}
            assert not refused, f"burst {burst}: {len(refused)} of {n} honest senders kept out: {next(iter(refused.values()))!r}"
            got = sorted(within(120, "receiving", lambda: [r.recv(timeout=60)["k"] for _ in range(n)]))
            assert got == list(range(n))
            for s in results.values():
                within(60, "close()", s.close)
    finally:
        r.close()


def test_tcp_arrays_held_after_the_receiver_is_closed_stay_exact(secret_env):
    r = bind(8)
    p = program(SENDER, r.address, 100, 2, 30, 6, "wait")
    try:
        held = within(300, "receiving 60 messages", lambda: [r.recv(timeout=120) for _ in range(60)])
        until(p, "closed")
        r.close()  # README: arrays already received stay valid
        junk = [np.full(4 << 20, k, dtype=np.uint8) for k in range(32)]
        time.sleep(2.5)  # past the arena's idle trim (a second)
        nxt = {}
        for m in held:
            assert m["i"] == nxt.get(m["s"], 0)
            nxt[m["s"]] = m["i"] + 1
            assert problem(m, 6) is None, "an array held past close() changed"
        assert nxt == {100: 30, 101: 30}
        del junk
        with pytest.raises(tq.Closed):
            r.recv(timeout=1)
    finally:
        end(p)


def test_tcp_recv_with_info_tells_apart_senders_of_one_process_and_counts_each(secret_env):
    r = bind(8)
    try:
        a = tq.Sender.connect(r.address, timeout=60)
        b = tq.Sender.connect(r.address, timeout=60)
        for i in range(6):
            (a if i % 2 == 0 else b).send(message(i % 2, i // 2, 5), timeout=60)
        infos = {}
        for _ in range(6):
            m, info = r.recv_with_info(timeout=60)
            assert problem(m, 5) is None
            infos.setdefault(m["s"], []).append((m["i"], info))
        assert set(infos) == {0, 1}
        conns = {s: {info["connection"] for _, info in v} for s, v in infos.items()}
        assert all(len(c) == 1 for c in conns.values()), conns
        assert conns[0] != conns[1], "two senders of one process share a connection id"
        for s, v in infos.items():
            assert [i for i, _ in v] == [0, 1, 2]
            seqs = [info["seq"] for _, info in v]
            assert seqs == sorted(seqs) and len(set(seqs)) == 3, f"sender {s}: seq {seqs}"
        a.close()
        b.close()
    finally:
        r.close()


def _wait(r, way, rng):
    if way == "timeout":
        while True:
            try:
                return r.recv(timeout=rng.random() * 2e-3)
            except tq.Timeout:
                pass
    if way == "try":
        while True:
            for _ in range(rng.randrange(30)):
                try:
                    return r.try_recv()
                except tq.Empty:
                    pass
            try:
                return r.recv(timeout=1e-6 + rng.random() * 5e-4)
            except tq.Timeout:
                pass
    return r.recv()


@pytest.mark.parametrize("way", ["recv", "timeout", "try"])
def test_tcp_ping_pong_loses_no_wake_up(secret_env, way):
    import random

    count = 1500
    a, b = bind(4), bind(4)
    try:
        to_b = tq.Sender.connect(b.address, timeout=60)
        to_a = tq.Sender.connect(a.address, timeout=60)
        failed = []

        def pong():
            rng = random.Random(2)
            try:
                for i in range(count):
                    m = _wait(b, way, rng)
                    assert m["i"] == i and problem(m, 4) is None, f"ping {i}"
                    if rng.random() < 0.5:
                        time.sleep(rng.random() * 200e-6)
                    to_a.send(message(1, i, 4))
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=pong, daemon=True)
        t.start()

        def ping():
            rng = random.Random(1)
            for i in range(count):
                to_b.send(message(0, i, 4))
                m = _wait(a, way, rng)
                assert (m["s"], m["i"]) == (1, i) and problem(m, 4) is None, f"answer {i}"
            return count

        assert within(300, f"{count} round trips waiting by {way}", ping) == count
        t.join(60)
        assert not failed, failed
        to_a.close()
        to_b.close()
    finally:
        a.close()
        b.close()
