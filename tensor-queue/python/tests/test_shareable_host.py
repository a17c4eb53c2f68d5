"""``tq.shareable()``'s allocator functions, called as torch's CUDAPluggableAllocator calls them
(through the shared object's C symbols), and its errors where torch or a GPU is missing."""

from __future__ import annotations

import ctypes
import importlib.util

import pytest

import tensor_queue as tq
from tensor_queue import _native


def allocator() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    lib = ctypes.CDLL(_native.__file__)
    alloc, free = lib.tq_shareable_alloc, lib.tq_shareable_free
    # torch's signatures: void* alloc(ssize_t, int, cudaStream_t); void free(void*, ssize_t, int, cudaStream_t)
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return alloc, free


def test_the_extension_exports_torchs_allocator_functions() -> None:
    alloc, free = allocator()
    assert alloc is not None and free is not None


def test_bad_requests_fail_as_null_and_unknown_frees_are_ignored() -> None:
    alloc, free = allocator()
    before = _native.shareable_blocks()
    assert alloc(-1, 0, None) is None, "a negative size is no allocation"
    assert alloc(4096, 4096, None) is None, "no GPU 4096"
    free(0xDEAD0000, 4096, 0, None)  # not ours: ignored, nothing crashes
    free(None, 0, 0, None)
    assert _native.shareable_blocks() == before


def test_allocate_and_free_channel_memory_where_a_gpu_is() -> None:
    alloc, free = allocator()
    before = _native.shareable_blocks()
    ptr = alloc(1 << 20, 0, None)
    if not tq.is_gpu_available():
        assert ptr is None, "no GPU here: the allocation fails as null (torch reports out of memory)"
        pytest.skip("no GPU here: allocating channel memory for torch needs one (the GPU tests cover it)")
    assert ptr, "GPU 0 gave no channel memory"
    assert _native.shareable_blocks() == before + 1
    free(ptr, 1 << 20, 0, None)
    assert _native.shareable_blocks() == before


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed: the GPU tests cover it")
def test_shareable_without_torch_is_a_clear_error() -> None:
    with pytest.raises(tq.TensorQueueError, match="needs torch"):
        with tq.shareable():
            pass
