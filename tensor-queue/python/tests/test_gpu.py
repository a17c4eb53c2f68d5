"""torch CUDA tensors between processes (these run on the GPU machine)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
import uuid

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here: the GPU tests run on the GPU machine")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here: the GPU tests run on the GPU machine", allow_module_level=True)

import tensor_queue as tq  # noqa: E402
import workers  # noqa: E402

ctx = mp.get_context("spawn")


def address() -> str:
    return os.path.join(tempfile.gettempdir(), f"tq-gpu-{uuid.uuid4().hex[:12]}.sock")


def connect(path: str, timeout: float = 60.0) -> tq.Sender:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return tq.Sender.connect(path)
        except tq.TensorQueueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def run_seed(skip_ordering: bool) -> tuple[dict, dict]:
    q, results = tq.Queue(), tq.Queue()
    child = ctx.Process(target=workers.gpu_produce_seed, args=(q, results, skip_ordering))
    child.start()
    warm = q.get(timeout=120)
    assert "warm" in warm
    msg = q.get(timeout=120)
    got = {"sum": float(msg["x"].double().sum()), "norm": float(msg["x"].double().norm())}
    assert msg["step"] == 3 and msg["x"].is_cuda
    want = results.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0
    return got, want


def test_seed_scenario_result_matches_with_work_still_queued() -> None:
    got, want = run_seed(skip_ordering=False)
    assert got == pytest.approx(want, rel=1e-6)


def test_seed_negative_control_ordering_after_an_idle_stream_reads_unfinished_data() -> None:
    got, want = run_seed(skip_ordering=True)
    assert got != pytest.approx(want, rel=1e-6), "without ordering the copy read the tensor before the matmuls"


def test_copy_path_strided_views_and_bf16() -> None:
    path = address()
    with tq.Receiver.bind(path) as receiver, tq.Sender.connect(path) as sender:
        x = torch.randn(64, 48, device="cuda")
        msg = {"x": x, "t": x.t(), "slice": x[::2, 5:17], "bf16": x.to(torch.bfloat16), "i": torch.arange(5, device="cuda")}
        before = tq.stats()["send_copies"]
        sender.send(msg)
        assert tq.stats()["send_copies"] == before + 5, "caching-allocator tensors are copied once each"
        got = receiver.recv(timeout=60)
        for key, want in msg.items():
            assert got[key].is_cuda and got[key].dtype == want.dtype and got[key].shape == want.shape, key
            assert torch.equal(got[key], want), key
        # The copy is the channel's: writing the received one leaves the producer's alone.
        got["x"].zero_()
        torch.cuda.synchronize()
        assert float(x.abs().sum()) > 0
        with pytest.raises(tq.NotSendable, match="never"):
            sender.send({"x": x}, copy="never")
        with pytest.raises(tq.NotSendable, match="grad"):
            sender.send({"w": torch.ones(2, device="cuda", requires_grad=True)})


def test_consumer_writes_reach_the_channel_memory_it_was_lent() -> None:
    path = address()
    done = ctx.Event()
    child = ctx.Process(target=workers.gpu_write_back, args=(path, done))
    child.start()
    sender = connect(path)
    x = torch.ones(1024, device="cuda")
    sender.send({"x": x})
    assert done.wait(60)
    child.join(60)
    assert child.exitcode == 0
    torch.cuda.synchronize()
    assert float(x.sum()) == 1024.0, "a copy was sent: the producer's tensor is its own"


def test_shareable_zero_copy_is_not_in_this_build() -> None:
    pytest.skip("tq.shareable() (zero copy through a torch MemPool over channel memory) is not implemented yet")


def test_producer_killed_with_work_queued() -> None:
    path = address()
    with tq.Receiver.bind(path) as receiver:
        child = ctx.Process(target=workers.gpu_send_then_die, args=(path,))
        child.start()
        child.join(120)
        assert child.exitcode == -signal.SIGKILL
        try:
            msg = receiver.recv(timeout=30)
        except (tq.ProducerFailed, tq.Disconnected):
            pass  # the message was dropped: its data was never finished
        else:
            # Delivered before the death was known: work ordered on it must not wait forever.
            done = torch.cuda.Event()
            total = msg["x"].sum()
            done.record()
            deadline = time.monotonic() + 30
            while not done.query():
                assert time.monotonic() < deadline, "work on a dead producer's tensor never became runnable"
                try:
                    receiver.try_recv()  # lets the receiver hear the hang-up
                except (tq.Empty, tq.Disconnected, tq.ProducerFailed):
                    pass
                time.sleep(0.01)
            assert float(total) in (0.0, float(1 << 20)), "the old data or the finished data, nothing else"
        # Nothing sticky: this process's GPU still works.
        assert float(torch.ones(4, device="cuda").sum()) == 4.0


def test_consumer_killed_holding_tensors() -> None:
    path = address()
    ready = ctx.Event()
    child = ctx.Process(target=workers.gpu_hold_then_die, args=(path, ready))
    child.start()
    sender = connect(path)
    sender.send({"x": torch.ones(1 << 22, device="cuda")})
    assert ready.wait(120)
    assert sender.outstanding() == 1
    os.kill(child.pid, signal.SIGKILL)
    child.join(60)
    assert sender.wait_released(60), "a killed consumer's tensors come back"
    tq.memory.trim()


def test_two_gpus_tensor_lands_on_the_consumers_gpu() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU here: the two-GPU test needs two")
    path, out = address(), tq.Queue()
    child = ctx.Process(target=workers.gpu_receive_on, args=(path, 1, out))
    child.start()
    sender = connect(path)
    sender.send({"x": torch.ones(1000, device="cuda:0")})
    got = out.get(timeout=120)
    child.join(60)
    assert got["sum"] == 1000.0
    assert got["device"].startswith("cuda"), got


def test_100_000_messages_without_device_memory_growth() -> None:
    n = 100_000
    path, out = address(), tq.Queue()
    child = ctx.Process(target=workers.gpu_consume_many, args=(path, n, out))
    child.start()
    sender = connect(path)
    x = torch.arange(16, dtype=torch.float32, device="cuda")
    for i in range(n):
        if i == 1000:
            torch.cuda.synchronize()
            first = tq.memory.usage()["device_bytes"]
        sender.send({"x": x + i})
    got = out.get(timeout=300)
    child.join(60)
    assert child.exitcode == 0
    assert got["total"] == sum(float(i) for i in range(0, n, 1000))
    torch.cuda.synchronize()
    assert tq.memory.usage()["device_bytes"] <= max(first, 64 << 20) * 2, "the sender's channel memory stayed bounded"
    assert got["last"] <= max(got["first"], 64 << 20) * 2, "the receiver's mapped memory stayed bounded"
