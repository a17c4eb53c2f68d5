"""tensor_queue: typed channels between processes that carry tensors (NumPy, torch, any DLPack
array) without pickling.

    import tensor_queue as tq
    q = tq.Queue(maxsize=16)        # like multiprocessing.Queue: pass it to children
    q.put({"x": x, "step": 3})      # in a producer
    msg = q.get(timeout=5)          # in the consumer; raises queue.Empty on timeout

Messages are value trees: None, bool, int, float, str, bytes, list, tuple, dict and arrays,
nested. Types are kept (a tuple stays a tuple, an array comes back as the framework it left);
anything else raises ``NotSendable`` (a ``TypeError``) naming where it sits. Arrays are copied
once into channel memory at ``send`` (``stats()`` counts the copies; ``copy="never"`` refuses
instead): a torch CUDA tensor on the sender's current stream, with no CPU wait, since torch's
own memory is never exported. Received host memory is read-only: a NumPy array arrives with
``writeable=False`` (``arr.copy()`` to write); a torch host tensor arrives as a copy torch owns
(torch has no read-only tensors, and a write to read-only memory would kill the process). A CUDA
tensor arrives without a copy, ordered on the receiver's current stream; its memory goes back when
torch frees it and the work queued on it is done (see ``record_stream``). For zero copy, allocate
CUDA tensors inside ``with tq.shareable():`` (channel memory): those are sent without a copy and
the consumer's writes reach the producer.
"""

from __future__ import annotations

from typing import Any

from . import _native
from ._errors import (
    Closed,
    Disconnected,
    Empty,
    Full,
    InvalidArgument,
    NoReceiver,
    NotSendable,
    NotTheConsumer,
    PeerRefused,
    ProducerFailed,
    ProtocolError,
    Rejected,
    RouteRefused,
    SystemCallError,
    TensorQueueError,
    Timeout,
    TooLarge,
    UsedAfterFork,
)
from ._native import Array, Broadcast, Receiver, Sender, is_gpu_available, reset_stats, stats
from ._queue import Queue
from ._shareable import shareable, shareable_pool
from . import memory

__version__: str = _native.version()


def record_stream(tensor: Any, stream: Any) -> None:
    """Makes the memory of a CUDA tensor received from a channel go back only after the work
    queued on ``stream`` (a ``torch.cuda.Stream``) by the time torch frees the tensor is done.

    A received tensor already waits for the stream that was current when it was received; call
    this for every other stream that uses it. ``tensor.record_stream`` does nothing here: torch
    only tracks memory its own allocator gave out. Pass the received tensor itself (not a view).
    """
    if not _native.record_stream(int(tensor.data_ptr()), int(stream.cuda_stream)):
        raise InvalidArgument("not a CUDA tensor received from a tensor_queue channel (pass the received tensor, not a view)")


def doctor() -> dict[str, Any]:
    """What this process can use: versions, GPUs, and whether a channel works here (a round trip
    through a fresh channel). For the whole report run the ``tq doctor`` command."""
    import os
    import sys
    import tempfile

    report: dict[str, Any] = {
        "tensor_queue": __version__,
        "python": sys.version.split()[0],
        "gpu_available": is_gpu_available(),
    }
    for module in ("numpy", "torch"):
        try:
            report[module] = __import__(module).__version__
        except ImportError:
            report[module] = None
    if report["torch"] is not None:
        import torch

        # The fast path for torch tensors (no Python calls per tensor); else `__dlpack__`.
        report["torch_exchange_api"] = _native.has_exchange_api(torch.empty(0))
    path = os.path.join(tempfile.gettempdir(), f"tq-doctor-{os.getpid()}.sock")
    try:
        with Receiver.bind(path) as receiver, Sender.connect(path) as sender:
            sender.send({"ping": (1, b"2")})
            report["channel_ok"] = receiver.recv(timeout=10) == {"ping": (1, b"2")}
    except TensorQueueError as error:
        report["channel_ok"] = False
        report["channel_error"] = str(error)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return report


__all__ = [
    "Array",
    "Broadcast",
    "Closed",
    "Disconnected",
    "Empty",
    "Full",
    "InvalidArgument",
    "NoReceiver",
    "NotSendable",
    "NotTheConsumer",
    "PeerRefused",
    "ProducerFailed",
    "ProtocolError",
    "Queue",
    "Receiver",
    "Rejected",
    "RouteRefused",
    "Sender",
    "SystemCallError",
    "TensorQueueError",
    "Timeout",
    "TooLarge",
    "UsedAfterFork",
    "doctor",
    "is_gpu_available",
    "memory",
    "record_stream",
    "reset_stats",
    "shareable",
    "shareable_pool",
    "stats",
]
