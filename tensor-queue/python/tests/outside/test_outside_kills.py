"""Peers SIGKILLed at worse moments: a producer in the middle of big sends, a consumer while the
producer is blocked on a full queue."""

import os
import random
import signal
import time

import numpy as np
import pytest

import tensor_queue as tq

from . import _workers


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.5])
def test_producer_killed_during_big_sends(sock_path, ctx, delay):
    r = tq.Receiver.bind(sock_path, capacity=4)
    ready = ctx.Event()
    p = ctx.Process(target=_workers.send_big_forever, args=(sock_path, ready))
    p.start()
    assert ready.wait(60)
    got = 0
    t = time.monotonic()
    while time.monotonic() - t < delay + random.random() * 0.1:
        m = r.recv(timeout=30)
        assert m["i"] == got and m["a"][0] == got % 251 and m["a"][-1] == got % 251
        got += 1
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    while True:
        try:
            m = r.recv(timeout=20)
        except (tq.Disconnected, tq.ProducerFailed):
            break
        assert m["i"] == got
        assert int(m["a"].min()) == int(m["a"].max()) == got % 251, "a torn array was delivered"
        got += 1
        del m
    r.close()


def test_consumer_killed_while_producer_blocked_on_full_queue(sock_path, ctx):
    bound = ctx.Event()
    p = ctx.Process(target=_workers.bind_and_sleep, args=(sock_path, bound))
    p.start()
    assert bound.wait(60)
    s = tq.Sender.connect(sock_path)
    with pytest.raises((TimeoutError, tq.Full)):
        for _ in range(50):
            s.send(np.zeros(1000), timeout=0.3)
    import threading

    result = []

    def blocked_send():
        try:
            for _ in range(50):
                s.send(np.zeros(1000))
            result.append("sent")
        except BaseException as e:
            result.append(e)

    th = threading.Thread(target=blocked_send, daemon=True)
    th.start()
    time.sleep(0.5)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    th.join(30)
    assert not th.is_alive(), "send blocked on a full queue hangs after the consumer died"
    assert len(result) == 1 and isinstance(result[0], tq.Disconnected), result
    assert s.wait_released(30)
