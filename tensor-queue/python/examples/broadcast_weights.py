"""A trainer hands new weights to several inference workers with tensor_queue.Broadcast.

Each version is copied once into channel memory and all workers map that one copy. A worker
keeps serving the weights it has until the next version has arrived (a received tensor is usable
on the worker's stream at once), then drops the old ones; the trainer sees the memory of a
version come back once every worker has let go (wait_released). Run: python3 broadcast_weights.py
"""

import multiprocessing as mp
import os
import tempfile
import time
import uuid

import torch

import tensor_queue as tq

WORKERS = 3
VERSIONS = 5


def worker(inbox: str, results: tq.Queue) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tq.Receiver.bind(inbox) as weights_in:
        weights = weights_in.recv(timeout=120)  # the first version
        batch = torch.ones(64, 1024, device=device)
        served = 0
        while True:
            out = batch @ weights["w"]  # serving with the weights it has
            served += 1
            try:
                new = weights_in.try_recv()
            except tq.Empty:
                continue
            except tq.Disconnected:
                break
            weights = new  # the old version is let go here, after the work queued on it
        results.put({"pid": os.getpid(), "version": weights["version"], "served": served, "check": float(out[0, 0])})


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = mp.get_context("spawn")
    inboxes = [os.path.join(tempfile.gettempdir(), f"tq-weights-{uuid.uuid4().hex[:8]}.sock") for _ in range(WORKERS)]
    results = tq.Queue()
    procs = [ctx.Process(target=worker, args=(inbox, results)) for inbox in inboxes]
    for p in procs:
        p.start()
    senders = []
    for inbox in inboxes:
        while True:
            try:
                senders.append(tq.Sender.connect(inbox))
                break
            except tq.TensorQueueError:
                time.sleep(0.01)
    broadcast = tq.Broadcast(senders)
    w = torch.zeros(1024, 1024, device=device)
    for version in range(1, VERSIONS + 1):
        w += 1.0 / 1024  # a training step
        broadcast.send({"w": w, "version": version})  # one copy for every worker
        time.sleep(0.2)
    print("outstanding per worker before they stop:", broadcast.outstanding())
    del broadcast
    for s in senders:
        s.close()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    for g in sorted(got, key=lambda g: g["pid"]):
        print(f"worker {g['pid']}: served {g['served']} batches, last weights version {g['version']}, out[0,0]={g['check']:.1f}")
    assert all(g["version"] == VERSIONS for g in got)
    assert all(abs(g["check"] - VERSIONS * 1024 / 1024 * 1.0) < 1e-3 for g in got)
    print("memory here:", tq.memory.usage())


if __name__ == "__main__":
    main()
