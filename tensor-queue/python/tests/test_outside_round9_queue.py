"""Round 9 of the outside tests, the ``tq.Queue`` findings: processes racing to be the consumer, a
consumer's forked child, consumer children that leave no files, producers that follow a consumer
taken over by another process, and ``put`` that does not wait for a consumer when told not to.
Every wait is bounded; no bound is a speed assertion."""

import glob
import multiprocessing as mp
import os
import queue
import signal
import time

import pytest

import helpers
import tensor_queue as tq

# --- run in child processes (importable by name by spawn and forkserver children) ---


def race_for_get(q, barrier, results, done):
    barrier.wait(30)
    try:
        q.get(timeout=0.2)
        out = "got a message"
    except tq.NotTheConsumer:
        out = "NotTheConsumer"
    except tq.Empty:
        out = "consumer"
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = f"{type(e).__name__}: {e}"
    results.put(out)
    done.wait(30)  # stays alive, so the winner stays the consumer while the others try


def get_one(q):
    q.get(timeout=30)


def consume_then_die(q, n, log):
    log.put([q.get(timeout=30) for _ in range(n)])
    log.close()
    log.join_thread()  # flushed before the kill
    os.kill(os.getpid(), signal.SIGKILL)


def consume_until_told(q, enough, stop, producer_done, log):
    got = []
    try:
        while len(got) < enough:
            got.append(q.get(timeout=15))
    finally:
        stop.set()
        log.put(("consumer", got))
        # Reads on until the producer has stopped, so that its last put finds room and a consumer.
        end = time.monotonic() + 30
        while not producer_done.is_set() and time.monotonic() < end:
            try:
                q.get(timeout=0.1)
            except tq.Empty:
                pass


def produce_until_told(q, first, go, stop, done, log):
    errors, i = [], 0
    try:
        while not stop.is_set() and i < 100_000:
            if i == first and not go.wait(30):  # the test's word: the first consumer is dead
                errors.append("no word from the test")
            q.put(i, timeout=30)
            i += 1
    except Exception as e:  # noqa: BLE001 - reported to the test
        errors.append(f"put {i}: {type(e).__name__}: {e}")
    done.set()
    log.put(("producer", errors))


# --- the tests ---


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork")
def test_processes_racing_to_get_make_one_consumer_and_the_others_not_the_consumer():
    ctx = mp.get_context("fork")  # children start at once: the race is closest
    for trial in range(30):
        q = tq.Queue()
        n = 8
        barrier, results, done = ctx.Barrier(n), ctx.Queue(), ctx.Event()
        children = [ctx.Process(target=race_for_get, args=(q, barrier, results, done)) for _ in range(n)]
        for c in children:
            c.start()
        try:
            outs = sorted(results.get(timeout=30) for _ in children)
        finally:
            done.set()
            for c in children:
                c.join(30)
        assert outs == ["NotTheConsumer"] * (n - 1) + ["consumer"], f"trial {trial}: {outs}"


FORK_CHILD_EXITS = r"""
import os, sys
import tensor_queue as tq
q = tq.Queue(connect_timeout=10)
try:
    q.get(timeout=0.01)  # this program is the consumer
except tq.Empty:
    pass
pid = os.fork()
if pid == 0:  # the child: not the consumer while its parent lives, and it exits normally
    try:
        q.get(timeout=0.01)
    except tq.NotTheConsumer:
        sys.exit(0)
    sys.exit(3)
status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(q.address, status, os.path.exists(q.address), os.path.exists(q.address + ".consumer"), flush=True)
print("got", q.get(timeout=30), flush=True)
"""


def test_a_forked_child_of_the_consumer_that_exits_leaves_the_consumer_reachable():
    prog = helpers.program(FORK_CHILD_EXITS)
    try:
        line = helpers.line_of(prog, 30)
        address, child, sock, lock = line.rsplit(" ", 3)
        assert child == "0", "the forked child's get did not raise NotTheConsumer"
        assert (sock, lock) == ("True", "True"), f"the child's exit removed the consumer's files: {line}"
        tq.Queue(address=address, connect_timeout=10).put("hello")
        assert helpers.line_of(prog, 30) == "got hello"
        assert prog.wait(30) == 0, prog.stderr.read()
    finally:
        if prog.poll() is None:
            prog.kill()
        prog.communicate()


@pytest.mark.parametrize("method", [m for m in ("fork", "forkserver") if m in mp.get_all_start_methods()])
def test_a_consumer_child_removes_its_files_when_it_returns(method):
    q = tq.Queue(connect_timeout=30)
    child = mp.get_context(method).Process(target=get_one, args=(q,))
    child.start()
    q.put("hi")
    child.join(30)
    assert child.exitcode == 0
    assert glob.glob(q.address + "*") == [], f"a {method} consumer child left its files behind"


@pytest.mark.parametrize("method", [m for m in ("spawn", "fork") if m in mp.get_all_start_methods()])
def test_producers_reach_the_consumer_that_takes_over_from_a_dead_one(method):
    ctx = mp.get_context(method)
    q = tq.Queue(connect_timeout=30)
    first, enough = 5, 10
    go, stop, done, log = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    old = ctx.Process(target=consume_then_die, args=(q, first, log))
    producer = ctx.Process(target=produce_until_told, args=(q, first, go, stop, done, log))
    new = ctx.Process(target=consume_until_told, args=(q, enough, stop, done, log))
    old.start()
    producer.start()
    try:
        assert log.get(timeout=60) == list(range(first))
        old.join(30)
        assert old.exitcode == -signal.SIGKILL
        go.set()  # the producer's next put finds the consumer dead
        new.start()
        results = dict([log.get(timeout=60), log.get(timeout=60)])
        new.join(30)
        producer.join(30)
    finally:
        for c in (old, producer, new):
            if c.pid is not None and c.is_alive():
                c.kill()
    assert results["producer"] == [], "the producer could not reach the new consumer"
    # Sends are written in the background: the puts right after the death may be lost before the
    # producer notices it (as the docs say); the one that noticed, and every later one, arrive.
    got = results["consumer"]
    assert len(got) == enough and got == list(range(got[0], got[0] + enough)) and got[0] >= first, got
    assert new.exitcode == 0 and producer.exitcode == 0


def test_put_nowait_and_put_with_a_timeout_do_not_wait_for_a_consumer():
    q = tq.Queue(maxsize=2, connect_timeout=60)
    for put in (q.put_nowait, lambda m: q.put(m, block=False), lambda m: q.put(m, timeout=0.5)):
        start = time.monotonic()
        with pytest.raises(queue.Full, match="no consumer"):
            put("refused")
        assert time.monotonic() - start < 10, "waited for the consumer as long as connect_timeout"
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)  # this process is the consumer now
    q.put_nowait(1)
    q.put(2, timeout=5)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.1)  # full: the timeout bounds the wait for room too
    assert [q.get(timeout=5), q.get(timeout=5)] == [1, 2]
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)  # nothing of the refused puts was sent
