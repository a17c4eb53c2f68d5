"""A hostile peer on the real wire: `tq-hostile` (tests/src/bin/tq-hostile.rs, built by
`cargo xtask test`, which passes its path in TQ_HOSTILE) writes payloads no encoder of ours makes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import uuid

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HOSTILE = os.environ.get("TQ_HOSTILE") or os.path.join(ROOT, "target", "debug", "tq-hostile")

# A receiver in its own process, so that a stack overflow shows as its death, not pytest's.
RECEIVER = """
import sys, tensor_queue as tq
r = tq.Receiver.bind(sys.argv[1])
print("listening", flush=True)
try:
    got = r.recv(timeout=20)
    depth = 0
    while isinstance(got, list):
        got, depth = got[0], depth + 1
    print("received depth", depth, flush=True)
except tq.Rejected as e:
    print("rejected", e, flush=True)
except tq.Timeout:
    print("timeout", flush=True)
print("errors", r.take_errors(), flush=True)
"""


def exchange(depth: int) -> tuple[str, str]:
    """Runs the deep-value peer against a receiver; both outputs."""
    if not os.path.exists(HOSTILE):
        assert "TQ_HOSTILE" not in os.environ, f"TQ_HOSTILE={HOSTILE} does not exist"
        pytest.skip(f"SKIPPED: {HOSTILE} is not built (cargo build -p integration-tests --bin tq-hostile)")
    path = os.path.join(tempfile.gettempdir(), f"tq-deep-{uuid.uuid4().hex[:12]}.sock")
    receiver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(RECEIVER), path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    peer = None
    try:
        assert receiver.stdout.readline().strip() == "listening", receiver.stderr.read()
        peer = subprocess.run(
            [HOSTILE, "deep-value", path, str(depth)], capture_output=True, text=True, timeout=60
        )
        out, err = receiver.communicate(timeout=60)
    finally:
        for p in (receiver,):
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert receiver.returncode == 0, f"the receiver died (status {receiver.returncode}): {err[-2000:]}"
    return out, peer.stdout


def test_a_message_at_the_senders_nesting_limit_is_received():
    # The sender refuses values more than 64 levels below the root: 65 lists, the innermost
    # holding None at path length 65... is one too many, so 64 lists is the deepest it sends.
    out, peer = exchange(64)
    assert "received depth 64" in out, (out, peer)


def test_a_hostile_very_deep_message_is_refused_not_a_crash():
    out, peer = exchange(1_000_000)
    # A typed error for that message alone (postcard keeps no text of the decoder's reason).
    assert "rejected message 1" in out and "does not decode" in out, (out, peer)
    assert "done" in peer, peer  # and the sender's message was given back
