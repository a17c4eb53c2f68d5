"""``tensor_queue.Queue``: ``multiprocessing.Queue``'s shape over a tensor-queue channel.

The consumer model: **one consumer process**. The first process that calls ``get`` becomes the
queue's consumer (it binds the channel); ``get`` in any other process raises ``NotTheConsumer``
while that one lives. Any number of processes may ``put``; a ``put`` waits (up to
``connect_timeout``, default 60 s) for the consumer to appear. Messages from one producer arrive in
the order it put them. Pass the queue to children as an argument (it pickles as its address), with
any start method; in a child made by ``fork`` the queue opens fresh ends of its own.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any

from . import _native
from ._errors import Disconnected, Empty, Full, NoReceiver, NotTheConsumer, Timeout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cleanup(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


class Queue:
    """A multi-producer, single-consumer queue of messages (value trees with arrays).

    ``maxsize`` bounds the messages waiting for the consumer (0: the channel's default bound);
    ``put`` waits while it is full.
    """

    def __init__(self, maxsize: int = 0, *, address: str | None = None, connect_timeout: float = 60.0) -> None:
        if address is None:
            name = f"tq-{os.getpid()}-{uuid.uuid4().hex[:16]}.sock"
            address = os.path.join(tempfile.gettempdir(), name)
        self._address = address
        self._maxsize = int(maxsize)
        self._connect_timeout = float(connect_timeout)
        self._pid = os.getpid()
        self._sender: _native.Sender | None = None
        self._receiver: _native.Receiver | None = None
        # Opens this process's ends once, whatever the number of threads that first put or get
        # at the same time: two senders of one process would not keep a thread's order.
        self._opening = threading.Lock()

    @property
    def address(self) -> str:
        """The channel's address (a Unix socket path)."""
        return self._address

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles as its address: the unpickled queue opens its own ends when first used.
        return (_rebuild, (self._maxsize, self._address, self._connect_timeout))

    def _own_process(self) -> None:
        if self._pid != os.getpid():
            # A forked child: the parent's ends are not ours; open our own when needed.
            self._pid = os.getpid()
            self._sender = None
            self._receiver = None
            self._opening = threading.Lock()  # a parent's thread may have held it at the fork

    def _claim(self) -> _native.Receiver:
        lock = self._address + ".consumer"
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                try:
                    with open(lock) as f:
                        owner = int(f.read().strip() or "0")
                except (OSError, ValueError):
                    owner = 0
                if owner == os.getpid():
                    break
                if owner and _alive(owner):
                    raise NotTheConsumer(
                        f"pid {owner} consumes this tensor_queue.Queue ({self._address}): a Queue has one "
                        "consumer process, the first that calls get(); use one Queue per consumer"
                    ) from None
                _cleanup([lock, self._address])  # a dead consumer's leftovers
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            break
        receiver = _native.Receiver.bind(self._address, self._maxsize or None)
        weakref.finalize(self, _cleanup, [lock, self._address])
        return receiver

    def put(self, obj: Any, block: bool = True, timeout: float | None = None, *, stream: Any = None) -> None:
        """Sends ``obj`` to the consumer; waits while the queue is full (``Full`` after
        ``timeout`` seconds, at once when ``block`` is false). CUDA tensors are ordered after the
        work queued on ``stream`` (default: torch's current stream)."""
        self._own_process()
        if self._sender is None:
            with self._opening:
                if self._sender is None:
                    self._sender = self._connect()
        try:
            if not block:
                self._sender.try_send(obj)
            else:
                self._sender.send(obj, timeout=timeout, stream=stream)
        except Timeout:
            raise Full("the queue stayed full") from None

    def put_nowait(self, obj: Any) -> None:
        """``put(obj, block=False)``."""
        self.put(obj, block=False)

    def _connect(self) -> _native.Sender:
        deadline = time.monotonic() + self._connect_timeout
        while True:
            try:
                return _native.Sender.connect(self._address)
            except NoReceiver:  # the consumer has not bound the address yet
                pass
            except OSError as error:  # the same, said by the operating system
                if error.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                    raise
            except Exception as error:  # noqa: BLE001 - the Rust error for a missing socket
                if "No such file" not in str(error) and "refused" not in str(error).lower():
                    raise
            if time.monotonic() >= deadline:
                raise Disconnected(f"no consumer took {self._address} within {self._connect_timeout} s")
            time.sleep(0.005)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next message; raises ``Empty`` (a ``queue.Empty``) when none came within
        ``timeout`` seconds (at once when ``block`` is false). Makes this process the consumer."""
        self._own_process()
        if self._receiver is None:
            with self._opening:
                if self._receiver is None:
                    self._receiver = self._claim()
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            try:
                if not block:
                    return self._receiver.try_recv()
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self._receiver.recv(timeout=left)
            except Timeout:
                raise Empty("no message within the timeout") from None
            except Disconnected:
                # Every producer so far has gone; new ones may still come (as with mp.Queue).
                if not block or (deadline is not None and time.monotonic() >= deadline):
                    raise Empty("no message, and no producer is connected") from None
                time.sleep(0.01)

    def get_nowait(self) -> Any:
        """``get(block=False)``."""
        return self.get(block=False)

    def close(self) -> None:
        """Closes this process's ends of the queue."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rebuild(maxsize: int, address: str, connect_timeout: float) -> Queue:
    return Queue(maxsize, address=address, connect_timeout=connect_timeout)
