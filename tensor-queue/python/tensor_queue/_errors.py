"""The exceptions of tensor_queue: the Rust error names, under one base class, each also a
subclass of the builtin exception that means the same (so ``except queue.Empty``,
``except TimeoutError``, ``except EOFError`` and ``except TypeError`` work as they do elsewhere)."""

from __future__ import annotations

import queue


class TensorQueueError(Exception):
    """Base class of every tensor_queue error."""


class Disconnected(TensorQueueError, EOFError):
    """The peer is gone; everything it sent before was delivered first."""


class Timeout(TensorQueueError, TimeoutError):
    """``recv``/``send`` waited the whole timeout, or ``Sender.connect`` did."""


class Empty(TensorQueueError, queue.Empty):
    """Nothing is waiting (``try_recv``), or ``Queue.get`` waited its whole timeout."""


class Full(TensorQueueError, queue.Full):
    """The receiver's queue is full (``try_send``, ``Queue.put`` with a timeout); nothing was sent."""


class ProducerFailed(TensorQueueError):
    """The producer died before its GPU work on the message was done; the message was dropped."""


class Rejected(TensorQueueError):
    """The receiver refused one message; the channel goes on."""


class RouteRefused(TensorQueueError):
    """The receiver's routing policy refuses the only route an array could take; nothing was sent."""


class NotSendable(TensorQueueError, TypeError):
    """A value a message cannot carry; the text names where it sits (``msg["box"][1]``)."""


class TooLarge(TensorQueueError, ValueError):
    """The message's non-array part is over the size limit: put bulk data in arrays."""


class PeerRefused(TensorQueueError, ConnectionRefusedError):
    """The peer was refused at the handshake (wrong secret, another version)."""


class NoReceiver(TensorQueueError, ConnectionRefusedError):
    """Nothing listens at the address ``Sender.connect`` was given (not bound yet, or gone)."""


class SystemCallError(TensorQueueError, OSError):
    """A call to the operating system failed (binding a path that is in use or too long, in a
    folder that does not exist; out of descriptors or memory); ``errno`` says which error where
    the system gave one, as Python's own ``OSError`` does."""


class ProtocolError(TensorQueueError):
    """A peer broke the protocol; its connection was closed."""


class InvalidArgument(TensorQueueError, ValueError):
    """An argument that makes no sense."""


class Closed(TensorQueueError):
    """The end was closed in this process."""


class UsedAfterFork(TensorQueueError, RuntimeError):
    """A channel end used in a child made by ``fork`` after the parent opened it."""


class NotTheConsumer(TensorQueueError, RuntimeError):
    """``Queue.get`` in a second process: a ``tensor_queue.Queue`` has one consumer process."""


__all__ = [
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
    "Rejected",
    "RouteRefused",
    "SystemCallError",
    "TensorQueueError",
    "Timeout",
    "TooLarge",
    "UsedAfterFork",
]
