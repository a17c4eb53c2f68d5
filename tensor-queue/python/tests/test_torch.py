"""torch tensors (host here; these run where torch is installed, e.g. on the GPU machine)."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import uuid

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here: the torch tests run on the GPU machine")

import tensor_queue as tq  # noqa: E402
import workers  # noqa: E402


def address() -> str:
    return os.path.join(tempfile.gettempdir(), f"tq-torch-{uuid.uuid4().hex[:12]}.sock")


def test_torch_host_tensors_come_back_as_writable_torch_tensors() -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    msg = {
        "x": x,
        "view": x.transpose(0, 2),
        "bf16": torch.linspace(-1, 1, 7, dtype=torch.bfloat16),
        "ints": (torch.tensor([1, 2], dtype=torch.int64), torch.tensor(True)),
    }
    path = address()
    with tq.Receiver.bind(path) as receiver, tq.Sender.connect(path) as sender:
        before = tq.stats()["receive_copies"]
        sender.send(msg, timeout=30)
        got = receiver.recv(timeout=30)
        assert tq.stats()["receive_copies"] == before + 5, "torch host tensors are copied at receipt"
    assert type(got["ints"]) is tuple
    for want, have in [(msg["x"], got["x"]), (msg["view"], got["view"]), (msg["bf16"], got["bf16"])]:
        assert isinstance(have, torch.Tensor) and have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have, want)
    got["x"].add_(1)  # writable: memory torch owns, never the read-only channel memory
    assert torch.equal(got["x"], x + 1)


def test_tensors_that_need_grad_are_refused_by_name() -> None:
    path = address()
    with tq.Receiver.bind(path), tq.Sender.connect(path) as sender:
        with pytest.raises(tq.NotSendable, match=r'msg\["w"\]'):
            sender.send({"w": torch.ones(2, requires_grad=True)})


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_torch_tensors_between_processes(method: str) -> None:
    ctx = mp.get_context(method)
    q = tq.Queue()
    child = ctx.Process(target=workers.produce_torch, args=(q, 3))
    child.start()
    try:
        got = [q.get(timeout=60) for _ in range(3)]
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(10)
            pytest.fail(f"the producer (pid {child.pid}) was still running after 30 s: killed")
    assert [m["i"] for m in got] == [0, 1, 2]
    assert all(isinstance(m["x"], torch.Tensor) and int(m["x"][0]) == m["i"] for m in got)
