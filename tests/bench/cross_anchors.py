"""Cross-device anchors for `tq-bench --only cross`, measured the way tq-bench measures its routes.

GPU0 -> GPU1, one process per GPU, times on CLOCK_MONOTONIC (time.monotonic_ns), shared by all
processes of the machine:
1. NCCL send/recv through torch.distributed (one process per GPU, torch.multiprocessing spawn,
   file:// store): one-shot one-way time from the send call to the data usable on GPU1 (the
   receiver synchronises, then reads the clock) at 1 MiB, 64 MiB and 1 GiB; and a 4 KiB ping-pong
   round trip (the receiver synchronises before answering).
2. The same with NCCL_P2P_DISABLE=1 (NCCL's shared-memory transport: the staged anchor), and
   with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (its network transport: the anchor of
   `tq-hosts`, whose channels across hosts run NCCL the same way).
3. torch.multiprocessing: a cuda:0 tensor put on a SimpleQueue; the consumer (on GPU1) calls
   .to('cuda:1') and synchronises: one-way put -> usable at 1 MiB and 64 MiB.

Progress goes to stderr; stdout gets one JSON object per part and the combined object last (the
line tq-bench reads). Without torch or without 2 GPUs it prints {"skipped": why} and exits 0.
Every wait is bounded: a part that does not finish in PART_TIMEOUT_S seconds is killed and
reported as an error; the other parts still run.
"""
import json
import os
import sys
import tempfile
import time

PART_TIMEOUT_S = float(os.environ.get("CROSS_PART_TIMEOUT_S", "90"))
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# (bytes, warm-up, measured) one-shot transfers.
NCCL_SIZES = [(4 * KIB, 20, 200), (MIB, 5, 50), (64 * MIB, 2, 20), (GIB, 1, 5)]
PINGPONG = (4 * KIB, 100, 1000)
MP_SIZES = [(MIB, 3, 30), (64 * MIB, 2, 15)]


def log(*what):
    print("cross_anchors:", *what, file=sys.stderr, flush=True)


def percentile(values, p):
    values = sorted(values)
    if not values:
        return None
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def nccl_worker(rank, init_file, out_dir, env):
    """One rank of the NCCL part: rank 0 on GPU0 sends, rank 1 on GPU1 receives."""
    os.environ.update(env)
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method="file://" + init_file, rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    device = torch.device("cuda", rank)
    big = torch.ones(NCCL_SIZES[-1][0], dtype=torch.uint8, device=device)
    stamps = {}
    for size, warmup, trips in NCCL_SIZES:
        x = big[:size]
        marks = []
        for _ in range(warmup + trips):
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            if rank == 0:
                time.sleep(0.001)  # the receiver has posted its recv, as tq-bench's consumer waits in recv
                start = time.monotonic_ns()
                dist.send(x, 1)
                torch.cuda.synchronize()
                marks.append(start)
            else:
                dist.recv(x, 0)
                torch.cuda.synchronize()
                marks.append(time.monotonic_ns())
        stamps[str(size)] = marks[warmup:]
    size, warmup, trips = PINGPONG
    x = big[:size]
    trip_ns = []
    dist.barrier(device_ids=[rank])
    torch.cuda.synchronize()
    for i in range(warmup + trips):
        if rank == 0:
            start = time.monotonic_ns()
            dist.send(x, 1)
            dist.recv(x, 1)
            torch.cuda.synchronize()
            if i >= warmup:
                trip_ns.append(time.monotonic_ns() - start)
        else:
            dist.recv(x, 0)
            torch.cuda.synchronize()
            dist.send(x, 0)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump({"stamps": stamps, "pingpong_ns": trip_ns}, f)
    dist.destroy_process_group()


def run_spawned(fn, args):
    """torch.multiprocessing.start_processes with a deadline; None or the error text."""
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + PART_TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                return "timed out after %.0f s" % PART_TIMEOUT_S
    except Exception as error:  # a rank failed: ProcessRaisedException / ProcessExitedException
        for process in context.processes:
            if process.is_alive():
                process.kill()
        lines = str(error).strip().splitlines()
        return "%s: %s" % (type(error).__name__, lines[-1] if lines else "")
    return None


NCCL_ENVS = {
    "nccl": {},
    "nccl_p2p_off": {"NCCL_P2P_DISABLE": "1"},
    "nccl_net": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}


def nccl_part(name):
    log(name, "start")
    with tempfile.TemporaryDirectory(prefix="tq-cross-anchors-") as out_dir:
        init_file = os.path.join(out_dir, "store")
        error = run_spawned(nccl_worker, (init_file, out_dir, NCCL_ENVS[name]))
        files = [os.path.join(out_dir, "rank%d.json" % rank) for rank in (0, 1)]
        if not all(os.path.exists(f) for f in files):
            return {"error": error or "a rank wrote no results"}
        with open(os.path.join(out_dir, "rank0.json")) as f:
            sender = json.load(f)
        with open(os.path.join(out_dir, "rank1.json")) as f:
            receiver = json.load(f)
    # Results written and then a hang or failure (in destroy_process_group): kept, with the error.
    result = {"one_way_p50_us": {}, "gbps": {}, "warning": error}
    for size, _, _ in NCCL_SIZES:
        times = [b - a for a, b in zip(sender["stamps"][str(size)], receiver["stamps"][str(size)])]
        p50 = percentile(times, 50)
        result["one_way_p50_us"][str(size)] = p50 / 1e3
        result["gbps"][str(size)] = size / p50 if p50 else None
    trips = sender["pingpong_ns"]
    result["pingpong_4k_p50_us"] = percentile(trips, 50) / 1e3
    result["pingpong_4k_p99_us"] = percentile(trips, 99) / 1e3
    log(name, json.dumps(result))
    return result


def mp_consumer(requests, answers):
    import torch

    torch.cuda.set_device(1)
    torch.empty(1, device="cuda:0")
    torch.empty(1, device="cuda:1")
    answers.put("ready")
    while True:
        item = requests.get()
        if item is None:
            break
        _sent, x = item
        y = x.to("cuda:1")
        torch.cuda.synchronize(1)
        done = time.monotonic_ns()
        del x, y, item
        answers.put(done)


def mp_part():
    import queue

    import torch
    import torch.multiprocessing as mp

    log("mp_to_cuda1 start")
    ctx = mp.get_context("spawn")
    requests, answers = ctx.SimpleQueue(), ctx.Queue()
    consumer = ctx.Process(target=mp_consumer, args=(requests, answers), daemon=True)
    consumer.start()
    result = {"one_way_p50_us": {}, "gbps": {}}
    try:
        if answers.get(timeout=PART_TIMEOUT_S) != "ready":
            return {"error": "the consumer did not say ready"}
        for size, warmup, trips in MP_SIZES:
            x = torch.ones(size, dtype=torch.uint8, device="cuda:0")
            torch.cuda.synchronize(0)
            times = []
            for i in range(warmup + trips):
                start = time.monotonic_ns()
                requests.put((start, x))
                done = answers.get(timeout=60)
                if i >= warmup:
                    times.append(done - start)
            p50 = percentile(times, 50)
            result["one_way_p50_us"][str(size)] = p50 / 1e3
            result["gbps"][str(size)] = size / p50
        requests.put(None)
        consumer.join(timeout=30)
    except queue.Empty:
        result["error"] = "no answer from the consumer within the time limit"
    finally:
        if consumer.is_alive():
            consumer.kill()
    log("mp_to_cuda1", json.dumps(result))
    return result


def main():
    try:
        import torch
    except Exception as error:  # ImportError, or a broken install
        print(json.dumps({"skipped": "torch is not importable with %s: %s" % (sys.executable, error)}))
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(json.dumps({"skipped": "needs 2 GPUs, torch sees %d" % count}))
        return
    out = {"torch": torch.__version__, "nccl": None, "gpus": torch.cuda.device_count()}
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    parts = [(name, lambda name=name: nccl_part(name)) for name in NCCL_ENVS] + [("mp_to_cuda1", mp_part)]
    # CROSS_ANCHOR_PARTS=nccl,nccl_net runs only those (tq-hosts wants the NCCL ones).
    wanted = os.environ.get("CROSS_ANCHOR_PARTS", "nccl,nccl_p2p_off,mp_to_cuda1").split(",")
    parts = [(name, part) for name, part in parts if name in wanted]
    for name, part in parts:
        started = time.monotonic()
        try:
            out[name] = part()
        except Exception as error:
            out[name] = {"error": "%s: %s" % (type(error).__name__, error)}
        out[name]["seconds"] = round(time.monotonic() - started, 1)
        print(json.dumps({"part": name, name: out[name]}), flush=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
