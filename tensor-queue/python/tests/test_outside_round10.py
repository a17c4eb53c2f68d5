"""Round 10 of the outside tests, from the Python side: what an outside tester found with only the
README and the package's stubs, as tests of the installed package. Every wait is bounded; no bound
is a speed assertion."""

import math
import os
import subprocess

import pytest

import helpers
import tensor_queue as tq
from test_hostile import HOSTILE

BIG_INTS = r"""
import sys
import tensor_queue as tq
s = tq.Sender.connect(sys.argv[1], timeout=30)
s.send({"seed": 2**20000, "neg": -(2**20000) - 1, "edge": [2**63, -(2**63) - 1, 2**64]})
s.send("next message")
s.close()
print("done", flush=True)
"""


def test_ints_of_any_size_cross_exactly():
    # Was: ints went as decimal text, which Python refuses beyond 4,300 digits by default: the
    # send raised a bare ValueError, and a receiver with the default bound lost the message of a
    # sender that had raised its own (no report on either side).
    assert sys_default_digit_bound()
    path = helpers.address("round10-ints")
    with tq.Receiver.bind(path) as r:
        with helpers.running(BIG_INTS, path) as sender:
            got = r.recv(timeout=30)
            assert got["seed"] == 2**20000 and got["neg"] == -(2**20000) - 1
            assert got["edge"] == [2**63, -(2**63) - 1, 2**64]
            assert all(type(v) is int for v in got["edge"])
            assert r.recv(timeout=30) == "next message"
            assert helpers.line_of(sender, 30) == "done"


def sys_default_digit_bound() -> bool:
    import sys

    return sys.get_int_max_str_digits() in (0, 4300)


def test_a_message_python_cannot_make_is_rejected_alone():
    # A peer's int text that is no number, or a dict keyed by a list, raised a bare ValueError or
    # TypeError from recv; now Rejected (a TensorQueueError), and the next message comes.
    if not os.path.exists(HOSTILE):
        assert "TQ_HOSTILE" not in os.environ, f"TQ_HOSTILE={HOSTILE} does not exist"
        pytest.skip(f"SKIPPED: {HOSTILE} is not built (cargo build -p integration-tests --bin tq-hostile)")
    path = helpers.address("round10-odd")
    with tq.Receiver.bind(path) as r:
        peer = subprocess.Popen([HOSTILE, "odd-values", path], stdout=subprocess.PIPE, text=True)
        try:
            with pytest.raises(tq.Rejected, match="Python objects"):
                r.recv(timeout=30)
            with pytest.raises(tq.Rejected, match="Python objects"):
                r.recv(timeout=30)
            assert r.recv(timeout=30) == -12345678901234567890, "an int in decimal, as older senders wrote them"
            assert r.recv(timeout=30) == 5
        finally:
            if peer.poll() is None:
                peer.kill()
            peer.communicate(timeout=30)


@pytest.mark.parametrize("maxsize", [2**40, "3", 2.5, None])
def test_a_queue_refuses_a_maxsize_it_cannot_keep_when_made(maxsize):
    # Was: accepted, then producers raised Full and the consumer's first get InvalidArgument, in
    # another process.
    with pytest.raises(tq.InvalidArgument, match="maxsize"):
        tq.Queue(maxsize=maxsize, address=helpers.address("round10-maxsize"))


def test_a_queue_takes_a_maxsize_of_zero_or_less_as_its_default_bound():
    path = helpers.address("round10-maxsize-neg")
    q = tq.Queue(maxsize=-1, address=path)  # queue.Queue's "no bound of mine"
    with q:
        with helpers.running(f"import tensor_queue as tq\ntq.Queue(address={path!r}).put(7)\nprint('put', flush=True)") as p:
            assert q.get(timeout=30) == 7
            assert helpers.line_of(p, 30) == "put"


@pytest.mark.parametrize("timeout", [-1, math.nan, math.inf, "1"])
def test_a_queue_refuses_a_bad_timeout_as_a_receiver_does(timeout):
    # Was: get(timeout=-1 or nan) raised Empty as if it had waited, put raised Full.
    q = tq.Queue(address=helpers.address("round10-timeout"))
    with q:
        with pytest.raises(tq.InvalidArgument, match="timeout"):
            q.get(timeout=timeout)
        with pytest.raises(tq.InvalidArgument, match="timeout"):
            q.put(1, timeout=timeout)
    with pytest.raises(tq.InvalidArgument, match="connect_timeout"):
        tq.Queue(address=helpers.address("round10-timeout"), connect_timeout=timeout)


class Foreign:
    """An array of a framework other than NumPy and torch: only the DLPack protocol."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_a_read_only_array_gives_no_legacy_capsule_that_could_be_written():
    # A DLPack capsule before version 1 cannot say "read-only": an older consumer could write
    # into memory mapped read-only and crash. NumPy refuses the same for its read-only arrays.
    np = pytest.importorskip("numpy")
    path = helpers.address("round10-dlpack")
    with tq.Receiver.bind(path) as r, tq.Sender.connect(path) as s:
        s.send(Foreign(np.arange(6, dtype=np.float32)))
        got = r.recv(timeout=30)
        assert isinstance(got, tq.Array)
        with pytest.raises(BufferError, match="read-only"):
            got.__dlpack__()
        assert got.__dlpack__(max_version=(1, 0)) is not None
        view = np.from_dlpack(got)
        assert not view.flags.writeable and view.tolist() == [0, 1, 2, 3, 4, 5]


def test_binding_fails_as_an_oserror_with_its_errno():
    # Was a bare TensorQueueError: `except OSError as e: if e.errno == errno.EADDRINUSE` missed it.
    import errno
    import tempfile

    path = helpers.address("round10-bind")
    with tq.Receiver.bind(path):
        with pytest.raises(tq.SystemCallError) as in_use:
            tq.Receiver.bind(path)
    assert isinstance(in_use.value, OSError) and in_use.value.errno == errno.EADDRINUSE, in_use.value
    missing = os.path.join(tempfile.gettempdir(), "round10-no-such-folder", "a.sock")
    with pytest.raises(OSError) as no_folder:
        tq.Receiver.bind(missing)
    assert no_folder.value.errno == errno.ENOENT and isinstance(no_folder.value, tq.TensorQueueError)


def test_a_huge_finite_timeout_means_as_long_as_it_takes():
    # Was: 1e20 (too large for the Rust side) waited for a consumer, then raised InvalidArgument
    # "not finite" and lost the message; get(timeout=1e20) raised it after taking the queue.
    path = helpers.address("round10-huge-timeout")
    q = tq.Queue(address=path)
    with q:
        code = f"import tensor_queue as tq\ntq.Queue(address={path!r}).put('hello', timeout=1e20)\nprint('put', flush=True)"
        with helpers.running(code) as producer:
            assert q.get(timeout=1e20) == "hello"
            assert helpers.line_of(producer, 30) == "put"
    with tq.Receiver.bind(helpers.address("round10-huge-recv")) as r:
        with pytest.raises(tq.Timeout):
            r.recv(timeout=0.0)
        r.set_spin(1e-6)
        with pytest.raises(tq.InvalidArgument, match="finite"):
            r.recv(timeout=math.inf)
