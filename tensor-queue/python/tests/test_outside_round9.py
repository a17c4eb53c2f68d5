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
        feeder = helpers.program(FEEDER, path)
        try:
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
        finally:
            feeder.kill()
            feeder.wait(10)
