"""torch CUDA tensors between processes (these run on the GPU machine)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import signal
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here: the GPU tests run on the GPU machine")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here: the GPU tests run on the GPU machine", allow_module_level=True)

import tensor_queue as tq  # noqa: E402
import helpers  # noqa: E402
import workers  # noqa: E402

ctx = mp.get_context("spawn")


def address() -> str:
    return helpers.address("tq-gpu")


def connect(path: str, timeout: float = 60.0) -> tq.Sender:
    return helpers.connect(path, timeout)


def finish(child, timeout: float, what: str) -> None:  # noqa: ANN001
    """Joins `child` within `timeout`; one still running is killed and the test fails saying so."""
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join(10)
        pytest.fail(f"{what} (pid {child.pid}) was still running after {timeout} s: killed")


def drain(log) -> list[str]:  # noqa: ANN001
    """What a child said on its `log` queue."""
    lines = []
    while True:
        try:
            lines.append(log.get(timeout=1))
        except queue.Empty:
            return lines


def run_seed(skip_ordering: bool) -> tuple[dict, dict]:
    """Runs the seed scenario between two children (producer and consumer); returns what each
    computed. With `skip_ordering` the consumer's receiver skips the stream wait (test switch)."""
    if skip_ordering and not tq._native.test_switches():
        pytest.skip(
            "this wheel was built without the test-switches feature, so ordering cannot be turned off: the GPU "
            "bundle's wheel has it (cargo xtask gpu-bundle builds it with --features test-switches)"
        )
    path, out = address(), ctx.Queue()
    consumer = ctx.Process(target=workers.gpu_seed_consume, args=(path, skip_ordering, out))
    consumer.start()
    producer = ctx.Process(target=workers.gpu_seed_produce, args=(path, secrets.randbelow(1 << 30), out))
    producer.start()
    said: dict[str, dict] = {}
    deadline = time.monotonic() + 180
    try:
        while len(said) < 2:
            try:
                report = out.get(timeout=1)
            except queue.Empty:
                died = {name: p.exitcode for name, p in (("consumer", consumer), ("producer", producer)) if p.exitcode}
                if died:
                    pytest.fail(f"the seed {died} exited before reporting (exit codes; their stderr is above)")
                if time.monotonic() > deadline:
                    pytest.fail(f"the seed processes did not both report within 180 s (got {sorted(said)})")
                continue
            said[report.pop("who")] = report
    finally:
        finish(consumer, 60, "the seed consumer")
        finish(producer, 60, "the seed producer")
    assert consumer.exitcode == 0, f"the seed consumer exited with {consumer.exitcode}"
    assert producer.exitcode == 0, f"the seed producer exited with {producer.exitcode}"
    got, want = said["consumer"], said["producer"]
    assert got.pop("step") == 3 and got.pop("cuda")
    got["paths"] = want.pop("paths")
    return got, want


def test_seed_scenario_result_matches_with_work_still_queued() -> None:
    got, want = run_seed(skip_ordering=False)
    values = {k: got[k] for k in want}
    assert values == pytest.approx(want, rel=1e-6), f"consumer saw {got}, producer computed {want}"


def test_seed_negative_control_skipped_ordering_reads_unfinished_data() -> None:
    got, want = run_seed(skip_ordering=True)
    values = {k: got[k] for k in want}
    assert values != pytest.approx(want, rel=1e-6), (
        f"with the receiver's stream wait skipped (TENSOR_QUEUE_TEST_SKIP_ORDERING=1) the consumer's checksum "
        f"should read the tensor before the producer's queued work wrote it, yet it saw the finished data: "
        f"consumer {got}, producer {want}"
    )


def test_copy_path_strided_views_and_bf16() -> None:
    path = address()
    with tq.Receiver.bind(path) as receiver, tq.Sender.connect(path) as sender:
        x = torch.randn(64, 48, device="cuda")
        msg = {"x": x, "t": x.t(), "slice": x[::2, 5:17], "bf16": x.to(torch.bfloat16), "i": torch.arange(5, device="cuda")}
        before = tq.stats()["send_copies"]
        sender.send(msg, timeout=60)
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
    sender.send({"x": x}, timeout=60)
    assert done.wait(60)
    finish(child, 60, "the child")
    assert child.exitcode == 0
    torch.cuda.synchronize()
    assert float(x.sum()) == 1024.0, "a copy was sent: the producer's tensor is its own"


def test_shareable_tensors_go_without_a_copy_and_the_consumers_writes_reach_the_producer() -> None:
    path = address()
    done = ctx.Event()
    child = ctx.Process(target=workers.gpu_add_one_in_place, args=(path, done))
    child.start()
    sender = connect(path)
    with tq.shareable():
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        grid = torch.arange(64 * 48, dtype=torch.float32, device="cuda").reshape(64, 48)
    assert tq._native.shareable_blocks() >= 1, "torch allocated from the channel memory pool"
    view = grid[::2, 5:17]  # strided: a view of the same block, still no copy
    before = tq.stats()
    sender.send({"x": x, "view": view}, timeout=60, copy="never")
    after = tq.stats()
    assert after["send_zero_copies"] == before["send_zero_copies"] + 2, (before, after)
    assert after["send_copies"] == before["send_copies"], "a shareable tensor was copied"
    assert done.wait(120), "the consumer did not say it wrote the tensors"
    finish(child, 60, "the consumer")
    assert child.exitcode == 0, f"the consumer exited with {child.exitcode}"
    # The consumer added 1 in place and synchronised before saying so: the producer's memory has it.
    want = torch.arange(1 << 20, dtype=torch.float64, device="cuda") + 1
    assert float((x.double() - want).abs().sum()) == 0.0, "the consumer's writes did not reach the producer's tensor"
    whole = torch.arange(64 * 48, dtype=torch.float64, device="cuda").reshape(64, 48)
    whole[::2, 5:17] += 1
    assert float((grid.double() - whole).abs().sum()) == 0.0, "the strided view's write-back is off"
    # A caching-allocator tensor would be copied: copy="never" refuses it.
    with pytest.raises(tq.NotSendable, match="never"):
        sender.send({"y": torch.ones(4, device="cuda")}, copy="never")
    sender.close()


def test_shareable_tensor_comes_back_when_the_receiver_lets_go() -> None:
    path = address()
    with tq.Receiver.bind(path) as receiver, tq.Sender.connect(path) as sender:
        with tq.shareable():
            x = torch.full((1 << 16,), 3.0, device="cuda")
        sender.send({"x": x}, timeout=60)
        got = receiver.recv(timeout=60)
        assert float(torch.sum(got["x"], dtype=torch.float64)) == 3.0 * (1 << 16)
        assert sender.outstanding() == 1
        del got
        torch.cuda.synchronize()
        assert sender.wait_released(60), "the receiver's hold on shareable memory comes back"


def test_producer_killed_with_work_queued() -> None:
    # The consumer runs in a child of its own: a stream left waiting on a dead producer would
    # hang every later GPU use of the process it ran in (and so every later test).
    log = ctx.Queue()
    child = ctx.Process(target=workers.gpu_receive_from_dying_producer, args=(log,))
    child.start()
    child.join(240)
    stuck = child.is_alive()
    if stuck:
        child.kill()
        child.join(10)
    lines = drain(log)
    said = "\n  ".join(lines)
    assert not stuck, f"the consumer was still running after 240 s (killed); it said:\n  {said}"
    assert child.exitcode == 0, f"the consumer exited with {child.exitcode}; it said:\n  {said}"
    assert any(line.endswith(f"producer exit code {-signal.SIGKILL}") for line in lines), said
    assert lines and lines[-1].endswith(" ok"), f"the consumer said:\n  {said}"
    assert any(line.endswith("a fresh tensor sums to 4.0") for line in lines), said


def test_consumer_killed_holding_tensors() -> None:
    path = address()
    ready = ctx.Event()
    child = ctx.Process(target=workers.gpu_hold_then_die, args=(path, ready))
    child.start()
    sender = connect(path)
    sender.send({"x": torch.ones(1 << 22, device="cuda")}, timeout=60)
    if not ready.wait(120):
        child.kill()
        child.join(10)
        pytest.fail("the consumer did not say it holds the tensor within 120 s")
    assert sender.outstanding() == 1
    os.kill(child.pid, signal.SIGKILL)
    finish(child, 60, "the child")
    assert sender.wait_released(60), "a killed consumer's tensors come back"
    tq.memory.trim()


def test_two_gpus_tensor_lands_on_the_consumers_gpu() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU here: the two-GPU test needs two")
    path, out = address(), tq.Queue()
    child = ctx.Process(target=workers.gpu_receive_on, args=(path, 1, out))
    child.start()
    sender = connect(path)
    sender.send({"x": torch.ones(1000, device="cuda:0")}, timeout=60)
    got = out.get(timeout=120)
    finish(child, 60, "the child")
    assert got["sum"] == 1000.0
    assert got["device"].startswith("cuda"), got


def test_route_reports_the_same_gpu_and_across_hosts_the_small_message_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    path = address()
    with tq.Receiver.bind(path), tq.Sender.connect(path) as sender:
        choice = sender.route(0)
        assert choice["route"] == "SameDevice", choice
        assert choice["target"] is not None and choice["reason"] is None, choice
    monkeypatch.setenv("TQ_SECRET", "a secret of at least 16 bytes for this test")
    with tq.Receiver.bind("tcp://127.0.0.1:0") as receiver:
        with tq.Sender.connect(receiver.address) as small, tq.Sender.connect(receiver.address, inline_gpu_up_to=0) as never:
            inline = small.route(0, gpu_bytes=4096)
            assert inline["route"] == "Tcp" and "inline" in (inline["reason"] or ""), inline
            assert small.route(0, gpu_bytes=1 << 20)["route"] == "Nccl"
            assert never.route(0, gpu_bytes=4096)["route"] == "Nccl"


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
        sender.send({"x": x + i}, timeout=60)
    got = out.get(timeout=300)
    finish(child, 60, "the child")
    assert child.exitcode == 0
    # Every message's 16 elements summed on the GPU: sum over i of (0 + 1 + ... + 15) + 16 i.
    assert got["total"] == 120.0 * n + 16.0 * n * (n - 1) / 2, got
    torch.cuda.synchronize()
    assert tq.memory.usage()["device_bytes"] <= max(first, 64 << 20) * 2, "the sender's channel memory stayed bounded"
    assert got["last"] <= max(got["first"], 64 << 20) * 2, "the receiver's mapped memory stayed bounded"
