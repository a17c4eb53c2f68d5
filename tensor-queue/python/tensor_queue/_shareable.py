"""``tensor_queue.shareable()``: torch CUDA tensors allocated from channel memory, sent without a copy.

Inside ``with tq.shareable():`` torch allocates CUDA tensors from a ``torch.cuda.MemPool`` over a
``torch.cuda.memory.CUDAPluggableAllocator`` whose malloc and free are C functions of this
package's extension (``tq_shareable_alloc`` / ``tq_shareable_free``): each segment torch asks for
is a block of the memory every channel exports. ``send`` recognises a tensor that lies in such a
block and sends a view of it (``stats()["send_zero_copies"]``), so the consumer works on the
producer's memory: its writes are visible to the producer once ordered (an event, a reply).

Lifetime: torch caches freed blocks in the pool and gives segments back only when the pool goes;
each device's pool lives as long as the process. A message holds its block, so memory a consumer
still holds stays mapped and valid whatever the producer frees. But torch may hand a block the
producer freed to its next tensor from the pool while a consumer still reads it: keep a tensor you
sent alive (or do not allocate from the pool again) until ``sender.outstanding()`` is 0 or
``sender.wait_released()`` returns, as with any memory two processes share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import _native
from ._errors import TensorQueueError

_POOLS: dict[int, Any] = {}
_ALLOCATOR: Any = None


def shareable_pool(device: Any = None) -> Any:
    """This process's ``torch.cuda.MemPool`` of channel memory on ``device`` (default: torch's
    current device), made on first use and kept for the life of the process."""
    global _ALLOCATOR
    try:
        import torch
    except ImportError:
        raise TensorQueueError("tensor_queue.shareable() needs torch (with CUDA)") from None
    if not torch.cuda.is_available():
        raise TensorQueueError("tensor_queue.shareable() needs a CUDA device torch can use")
    chosen = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    index = torch.cuda.current_device() if chosen.index is None else chosen.index
    if index not in _POOLS:
        if _ALLOCATOR is None:
            _ALLOCATOR = torch.cuda.memory.CUDAPluggableAllocator(
                _native.__file__, "tq_shareable_alloc", "tq_shareable_free"
            )
        _POOLS[index] = torch.cuda.MemPool(_ALLOCATOR.allocator())
    return _POOLS[index]


@contextlib.contextmanager
def shareable(device: Any = None) -> Iterator[Any]:
    """Within the block, torch allocates CUDA tensors on ``device`` (default: the current one)
    from channel memory: such a tensor is sent without a copy, and ``copy="never"`` accepts it.
    Yields the pool. See the module's documentation for the memory's lifetime."""
    pool = shareable_pool(device)  # raises where torch or CUDA is missing
    import torch

    with torch.cuda.use_mem_pool(pool, device=device):  # None: torch's current device
        yield pool
