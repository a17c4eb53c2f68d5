"""Functions the spawn/forkserver children run (importable by the children)."""

import os
import time

import numpy as np


def produce_ordered(q, producer_id, n):
    for i in range(n):
        q.put({"p": producer_id, "i": i, "a": np.full(3, i, dtype=np.int64)})


def put_values(q, values):
    for v in values:
        q.put(v)


def consume_n(q, n, out):
    got = [q.get(timeout=30) for _ in range(n)]
    out.put(len(got))


def send_forever(path, ready):
    import tensor_queue as tq

    s = tq.Sender.connect(path, timeout=30)
    ready.set()
    i = 0
    while True:
        s.send({"i": i, "a": np.arange(1000, dtype=np.float64) + i})
        i += 1


def hold_many(path, n, bound, ready):
    """Receives n arrays, keeps them all alive, then waits to be killed."""
    import tensor_queue as tq

    r = tq.Receiver.bind(path)
    bound.set()
    held = [r.recv(timeout=30) for _ in range(n)]
    ready.set()
    time.sleep(600)
    return held


def recv_then_report(path, q_out):
    import tensor_queue as tq

    r = tq.Receiver.bind(path)
    q_out.put("bound")
    msg = r.recv(timeout=30)
    q_out.put(msg)


def broadcast_receiver(path, ready, out):
    import tensor_queue as tq

    r = tq.Receiver.bind(path)
    ready.set()
    msg = r.recv(timeout=30)
    out.put((os.getpid(), msg["tag"], int(msg["w"].sum())))
    del msg
    time.sleep(0.5)


def put_then_die(q, n, done):
    for i in range(n):
        q.put({"i": i, "a": np.full(1000, i, dtype=np.int32)})
    done.set()
    time.sleep(600)


def try_get(q, out):
    import tensor_queue as tq

    try:
        q.get(timeout=2)
        out.put("got")
    except tq.NotTheConsumer as e:
        out.put(("NotTheConsumer", isinstance(e, RuntimeError)))
    except BaseException as e:
        out.put((type(e).__name__, str(e)))


def send_big_forever(path, ready):
    import tensor_queue as tq

    s = tq.Sender.connect(path, timeout=30)
    ready.set()
    i = 0
    while True:
        s.send({"i": i, "a": np.full(4 << 20, i % 251, dtype=np.uint8)})
        i += 1


def bind_and_sleep(path, bound):
    import tensor_queue as tq

    r = tq.Receiver.bind(path, capacity=2)
    bound.set()
    time.sleep(600)
    return r
