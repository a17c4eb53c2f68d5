"""This process's channel memory (shared-memory and device chunks)."""

from __future__ import annotations

from . import _native


def usage() -> dict[str, int]:
    """``host_bytes``, ``device_bytes`` (held in chunks) and ``in_use_bytes`` (of live arrays,
    including those a receiver still holds)."""
    return _native.memory_usage()


def trim() -> int:
    """Gives back every chunk that holds no live array now; returns the bytes given back."""
    return _native.memory_trim()


__all__ = ["trim", "usage"]
