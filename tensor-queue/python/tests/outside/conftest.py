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
