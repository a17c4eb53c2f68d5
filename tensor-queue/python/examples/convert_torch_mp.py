"""A torch.multiprocessing producer/consumer, converted to tensor_queue line by line.

The original lines are in the comments; four lines changed. Run: python3 convert_torch_mp.py
"""

import torch

# import torch.multiprocessing as mp
import multiprocessing as mp  # plain multiprocessing starts the processes now

import tensor_queue as tq  # new


def producer(q, n):  # noqa: ANN001
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(512, 512, device=device)
    for step in range(n):
        x = torch.randn(512, 512, device=device) @ w  # still queued on the GPU when put returns
        q.put({"x": x, "step": step})
    # torch.multiprocessing needed the producer alive (and x kept) until the consumer was done;
    # tensor_queue copied x into channel memory, ordered after the matmul: nothing to keep.


def main() -> None:
    ctx = mp.get_context("spawn")
    # q = ctx.Queue(maxsize=16)
    q = tq.Queue(maxsize=16)
    p = ctx.Process(target=producer, args=(q, 100))
    p.start()
    total = 0.0
    for _ in range(100):
        # msg = q.get(timeout=30)
        msg = q.get(timeout=30)  # the same call; raises queue.Empty on timeout
        total += float(msg["x"].float().mean())  # ordered on this process's current stream
    p.join()
    print(f"received 100 messages; mean of means {total / 100:.4f}; copies counted: {tq.stats()['send_copies']} here")


if __name__ == "__main__":
    main()
