"""Shared helpers of the outside tests: short socket paths, separate programs, start methods."""

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

START_METHODS = ["spawn", "forkserver"]


@pytest.fixture
def sock_path():
    """A fresh, short Unix socket path (sun_path is limited to 108 bytes)."""
    d = tempfile.mkdtemp(prefix="tqo-", dir="/tmp")
    yield os.path.join(d, "s")


@pytest.fixture(params=START_METHODS)
def ctx(request):
    import multiprocessing as mp

    return mp.get_context(request.param)


def program(code, *args, env=None, **kw):
    """Starts `code` as a separate Python program (same interpreter, same venv)."""
    e = dict(os.environ)
    if env:
        e.update(env)
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=e,
        # not the package's source folder, whose tensor_queue/ has no built _native
        cwd=kw.pop("cwd", tempfile.gettempdir()),
        **kw,
    )


def interrupt(prog, what, after=1.0):
    """Waits for `prog` to print "ready", Ctrl-C's it `after` seconds later and returns its
    (stdout, stderr); fails the test if it does not end within 15 s (a hang)."""
    import signal
    import time

    assert prog.stdout.readline().strip() == "ready"
    time.sleep(after)
    prog.send_signal(signal.SIGINT)
    try:
        return prog.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        prog.kill()
        prog.communicate()
        pytest.fail(f"SIGINT did not interrupt {what} within 15 s")
