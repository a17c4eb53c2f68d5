"""What the package's own tests share: fresh socket paths, connecting once a child has bound,
Ctrl-C'ing a separate program in the middle of a call, and separate programs whose lines are read
with a bound."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest

import tensor_queue as tq


def address(prefix: str = "tq-test") -> str:
    """A fresh Unix socket path in the temporary folder."""
    return os.path.join(tempfile.gettempdir(), f"{prefix}-{uuid.uuid4().hex[:12]}.sock")


def connect(path: str, timeout: float = 30.0) -> tq.Sender:
    """Connects once the child has bound `path`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return tq.Sender.connect(path)
        except tq.TensorQueueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def interrupt_program(code: str, *args: str, ready: str, before=None) -> tuple[str, str]:
    """Runs `code` as a separate program, waits for it to print `ready`, runs `before()` (if
    given), Ctrl-C's it half a second later and returns its (stdout, stderr)."""
    prog = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tempfile.gettempdir(),  # not the source folder, whose tensor_queue/ has no _native
    )
    try:
        assert prog.stdout.readline().strip() == ready, prog.stderr.read()
        if before is not None:
            before()
        time.sleep(0.5)  # into the call's wait
        prog.send_signal(signal.SIGINT)
        return prog.communicate(timeout=30)
    finally:
        if prog.poll() is None:
            prog.kill()
            prog.communicate()


def program(code: str, *args, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`code` run as a separate Python program with `args`, in a folder that is not the package's
    source, with `env` added to this process's environment; its stdin, stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **(env or {})),
        cwd=tempfile.gettempdir(),
    )


@contextlib.contextmanager
def running(code: str, *args, env: dict[str, str] | None = None):
    """`program(code, *args, env=env)` for the block, killed and reaped when it ends (a test that
    fails leaves no program behind)."""
    prog = program(code, *args, env=env)
    try:
        yield prog
    finally:
        prog.kill()
        prog.wait(10)


def line_of(prog: subprocess.Popen, bound: float) -> str:
    """The next line `prog` prints, within `bound` seconds (a hang fails the test)."""
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(prog.stdout.readline()), daemon=True)
    t.start()
    t.join(bound)
    if t.is_alive():
        prog.kill()
        pytest.fail(f"no line from the program within {bound} s")
    return out[0].strip()
