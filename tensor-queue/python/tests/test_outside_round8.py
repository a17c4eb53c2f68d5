"""Round 8 of the outside tests, from the Python side: what an outside tester found with only the
README and the package's stubs (TCP receivers and NumPy arrays), as tests of the installed
package. A receiver that is not reading yet (a server still setting up) while a storm of refused
connectors comes: it must keep no thread per connector, keep accepting honest senders, and keep a
bounded list of refusals. A sender program that exits with a large message its live receiver
never reads: its exit waits at most ``SENDER_DROP_TIMEOUT`` in all (the tests' switch shortens it
where the wheel has switches). Connecting to nobody, or to a listener that never answers, raises
the builtin exceptions that mean so. Every wait is bounded; no bound is a speed assertion."""

import errno
import os
import socket
import tempfile
import threading
import time

import pytest

import helpers
import tensor_queue as tq

SECRET = "outside-round8-python-secret-0123456789abcdef"


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("TQ_SECRET", SECRET)


def handshake_threads():
    """This process's threads named ``tq-handshake`` (the receiver's, one per handshake under way)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == "tq-handshake"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def program(code, *args, env=None):
    return helpers.program(code, *args, env={"TQ_SECRET": SECRET, **(env or {})})


HONEST = r"""
import sys
import tensor_queue as tq
with tq.Sender.connect(sys.argv[1], timeout=30) as s:
    s.send({"who": "honest", "n": 7}, timeout=30)
print("sent", flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_tcp_receiver_not_reading_yet_survives_a_storm_of_refused_connectors(secret_env):
    r = tq.Receiver.bind("tcp://127.0.0.1:0")
    port = int(r.address.rsplit(":", 1)[1])
    storm = 2000

    def hammer(n):
        for _ in range(n):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"hello garbage\n")

    hammers = [threading.Thread(target=hammer, args=(storm // 4,)) for _ in range(4)]
    for h in hammers:
        h.start()
    for h in hammers:
        h.join(120)
        assert not h.is_alive(), "the listener stopped accepting during the storm"
    deadline = time.monotonic() + 20
    while handshake_threads() >= 32 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handshake_threads() < 32, f"{handshake_threads()} handshake threads after {storm} refused connectors"
    honest = program(HONEST, r.address)
    try:
        assert helpers.line_of(honest, 60) == "sent", honest.stderr.read()[-2000:]
        assert r.recv(timeout=30) == {"who": "honest", "n": 7}
    finally:
        honest.kill()
        honest.wait(30)
    errors = r.take_errors()
    assert len(errors) == 1024, f"the last 1,024 refusals are kept, not {len(errors)}"
    r.close()


EXIT = r"""
import sys
import numpy as np
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
s.send({"x": np.zeros(256 << 20, dtype=np.uint8)}, timeout=30)
print("sent", flush=True)
"""


@pytest.mark.skipif(not tq._native.test_switches(), reason="needs a wheel built with test switches (the GPU bundle's)")
def test_tcp_sender_exit_with_a_message_unread_waits_one_drop_timeout_in_all(secret_env):
    bound = 2.0  # SENDER_DROP_TIMEOUT, shortened by the tests' switch
    r = tq.Receiver.bind("tcp://127.0.0.1:0")
    child = program(EXIT, r.address, env={"TENSOR_QUEUE_TEST_DROP_TIMEOUT_MS": str(int(bound * 1000))})
    try:
        assert helpers.line_of(child, 60) == "sent", child.stderr.read()[-2000:]
        sent = time.monotonic()
        child.wait(30)
        waited = time.monotonic() - sent
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == 0
    # Twice the bound was the bug (one wait for the message to leave, one for the link's bytes).
    assert waited < bound * 1.75, f"the sender's exit took {waited:.1f} s after its send (bound {bound} s)"
    deadline = time.monotonic() + 10
    errors = []
    while not errors and time.monotonic() < deadline:
        errors = r.take_errors()
        time.sleep(0.05)
    assert any("unfinished" in e for e in errors), errors
    r.close()


def test_connect_to_nobody_is_a_connection_refused_error_and_to_a_mute_listener_a_timeout(secret_env):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ConnectionRefusedError) as nobody:
        tq.Sender.connect(f"tcp://127.0.0.1:{port}", timeout=5)
    assert isinstance(nobody.value, tq.NoReceiver), repr(nobody.value)
    assert nobody.value.errno == errno.ECONNREFUSED, repr(nobody.value)  # as the system said
    missing = os.path.join(tempfile.gettempdir(), f"tq-round8-nobody-{os.getpid()}.sock")
    with pytest.raises(ConnectionRefusedError) as no_file:
        tq.Sender.connect(missing, timeout=5)
    assert no_file.value.errno == errno.ENOENT, repr(no_file.value)
    with socket.socket() as mute:  # accepts into its backlog, never says a word
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        started = time.monotonic()
        with pytest.raises(TimeoutError) as silent:
            tq.Sender.connect(f"tcp://127.0.0.1:{mute.getsockname()[1]}", timeout=1.0)
        assert isinstance(silent.value, tq.Timeout), repr(silent.value)
        assert time.monotonic() - started < 30, "the connect's timeout bounds it"


def test_an_array_of_too_many_dimensions_is_refused_with_a_sentence_that_names_it(tmp_path):
    np = pytest.importorskip("numpy")
    try:
        deep = np.zeros((1,) * 40)
    except ValueError:
        pytest.skip("this NumPy makes no array of 40 dimensions (NumPy 1 stops at 32)")
    with tq.Receiver.bind(str(tmp_path / "dims.sock")) as r, tq.Sender.connect(r.address) as s:
        with pytest.raises(tq.NotSendable) as caught:
            s.send({"x": deep})
        # Was "msg["x"] 40 dimensions; at most 32": the location, then a sentence about it.
        assert 'msg["x"] has 40 dimensions, more than the 32 a tensor may have' in str(caught.value), caught.value
        s.send("after")
        assert r.recv(timeout=10) == "after"
