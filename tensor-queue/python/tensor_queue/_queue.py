"""``tensor_queue.Queue``: ``multiprocessing.Queue``'s shape over a tensor-queue channel.

The consumer model: **one consumer process**. The first process that calls ``get`` becomes the
queue's consumer (it binds the channel); ``get`` in any other process raises ``NotTheConsumer``
while that one lives. Any number of processes may ``put``; a ``put`` waits (up to
``connect_timeout``, default 60 s) for the consumer to appear. Messages from one producer arrive in
the order it put them. Pass the queue to children as an argument (it pickles as its address), with
any start method; in a child made by ``fork`` the queue opens fresh ends of its own.

The consumer holds an exclusive ``flock`` on ``<address>.consumer`` while it lives (the kernel
drops it when the process dies, however it dies), and removes that file and the socket when it
exits, as a multiprocessing child too. A consumer that was killed leaves both files behind; the
next process that calls ``get`` takes over and reuses them. When the consumer died and another
took over, producers reconnect to the new one: messages put around the old consumer's death (sends
are written in the background, so until a producer's channel notices it gone) may be lost with it,
and the one whose send found it gone is sent again to the new one (at least once for that message).

Limitation: a child forked by ``os.fork`` (as multiprocessing's ``fork`` and ``forkserver`` do)
or by ``subprocess`` does not keep the consumer's lock, but a process forked by other means (C code
calling ``fork()`` without ``exec``) shares it while it lives: no other process can take the queue
over before that one exits too.
"""

from __future__ import annotations

import errno
import fcntl
import math
import numbers
import operator
import os
import tempfile
import threading
import time
import uuid
from multiprocessing import util as _mp_util
from typing import Any

from . import _native
from ._errors import Disconnected, Empty, Full, InvalidArgument, NoReceiver, NotTheConsumer, Timeout

# The descriptors of the consumer locks this process holds. A child made by os.fork closes its
# copies at once: with them open, the lock would outlive the consumer while the child lives.
_held_locks: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in _held_locks:
        try:
            os.close(fd)  # closing a copy keeps the parent's lock; flock(LOCK_UN) would drop it
        except OSError:
            pass
    _held_locks.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _release(pid: int, address: str, lock: str, fd: int) -> None:
    """The consumer's cleanup: runs when its Queue is collected or the process exits (atexit, or
    a multiprocessing child's own exit path), only in the process that claimed the queue."""
    if os.getpid() != pid:
        return
    # The files go while the lock is still held, so that no new consumer's files are removed.
    _unlink(address)
    _unlink(lock)
    _held_locks.discard(fd)
    try:
        os.close(fd)
    except OSError:
        pass


def _owner(fd: int) -> str:
    try:
        pid = int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return "another process"  # the winner has not written its PID yet
    return f"pid {pid}"


_MAX_CAPACITY = 2**32 - 1


def _checked_maxsize(maxsize: Any) -> int:
    """``maxsize`` as a capacity: an int, at most the channel's largest; 0 or less is the
    channel's default bound (as ``queue.Queue`` takes 0 or less for no bound of the caller's)."""
    try:
        size = operator.index(maxsize)
    except TypeError:
        raise InvalidArgument(f"maxsize={maxsize!r}: a whole number of messages") from None
    if size > _MAX_CAPACITY:
        raise InvalidArgument(f"maxsize={size}: at most {_MAX_CAPACITY} messages")
    return max(0, size)


def _seconds(value: Any, what: str) -> float | None:
    """``value`` as a number of seconds (``None`` stays ``None``), checked where it is given, as
    ``Receiver.recv`` checks its own: a negative, NaN or infinite one raises ``InvalidArgument``."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{what}={value!r}: a number of seconds, 0 or more")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InvalidArgument(f"{what}={value!r}: a finite number of seconds, 0 or more")
    return seconds


def _no_consumer(error: Exception) -> bool:
    """Whether ``Sender.connect`` failed because no consumer listens at the address (yet), or the
    one there died during the handshake."""
    if isinstance(error, (NoReceiver, Timeout, Disconnected)):
        return True
    if isinstance(error, OSError):
        return error.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE)
    text = str(error)  # the Rust error for a missing socket
    return "No such file" in text or "refused" in text.lower()


class Queue:
    """A multi-producer, single-consumer queue of messages (value trees with arrays).

    ``maxsize`` bounds the messages waiting for the consumer (0 or less: the channel's default
    bound); ``put`` waits while it is full. A ``maxsize`` that is not a whole number up to
    2**32 - 1, or a ``connect_timeout`` that is not a number of seconds, raises
    ``InvalidArgument`` here, not in the process that first uses the queue.
    """

    def __init__(self, maxsize: int = 0, *, address: str | None = None, connect_timeout: float = 60.0) -> None:
        if address is None:
            name = f"tq-{os.getpid()}-{uuid.uuid4().hex[:16]}.sock"
            address = os.path.join(tempfile.gettempdir(), name)
        self._address = address
        self._maxsize = _checked_maxsize(maxsize)
        connect = _seconds(connect_timeout, "connect_timeout")
        if connect is None:
            raise InvalidArgument("connect_timeout=None: a number of seconds, 0 or more")
        self._connect_timeout = connect
        self._pid = os.getpid()
        self._sender: _native.Sender | None = None
        self._receiver: _native.Receiver | None = None
        self._lock_fd: int | None = None  # the consumer lock, held from the first get on
        # Open this process's ends once, whatever the number of threads that first put or get at
        # the same time: two senders of one process would not keep a thread's order. One lock an
        # end, so that a put waiting for a consumer does not keep this process's get from becoming it.
        self._opening_sender = threading.Lock()
        self._opening_receiver = threading.Lock()

    @property
    def address(self) -> str:
        """The channel's address (a Unix socket path)."""
        return self._address

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles as its address: the unpickled queue opens its own ends when first used.
        return (_rebuild, (self._maxsize, self._address, self._connect_timeout))

    def _own_process(self) -> None:
        if self._pid != os.getpid():
            # A forked child: the parent's ends are not ours; open our own when needed. Its copy of
            # the consumer lock was closed at the fork (_close_inherited_locks).
            self._pid = os.getpid()
            self._sender = None
            self._receiver = None
            self._lock_fd = None
            # A parent's thread may have held them at the fork.
            self._opening_sender = threading.Lock()
            self._opening_receiver = threading.Lock()

    def _claim(self) -> _native.Receiver:
        if self._lock_fd is None:
            self._lock_fd = self._take_lock()
            # The previous consumer's socket, if it died without removing it: we hold the lock, so
            # no consumer lives there.
            _unlink(self._address)
        return _native.Receiver.bind(self._address, self._maxsize or None)

    def _take_lock(self) -> int:
        lock = self._address + ".consumer"
        while True:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)  # not inherited across exec
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _owner(fd)
                os.close(fd)
                raise NotTheConsumer(
                    f"{owner} consumes this tensor_queue.Queue ({self._address}): a Queue has one "
                    "consumer process, the first that calls get(); use one Queue per consumer"
                ) from None
            try:
                ours = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                ours = False
            if ours:
                break
            # A leaving consumer removed the file between our open and our lock: lock the new one.
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # for the others' error messages only
        _held_locks.add(fd)
        # Runs when the Queue is collected and at exit: atexit in a main process, and the exit path
        # of a multiprocessing child (which leaves with os._exit, past weakref.finalize and atexit).
        _mp_util.Finalize(self, _release, args=(os.getpid(), self._address, lock, fd), exitpriority=0)
        return fd

    def put(self, obj: Any, block: bool = True, timeout: float | None = None, *, stream: Any = None) -> None:
        """Sends ``obj`` to the consumer. CUDA tensors are ordered after the work queued on
        ``stream`` (default: torch's current stream).

        ``put(obj)`` waits while the queue is full, and waits up to ``connect_timeout`` for a
        consumer to take the queue (``Disconnected`` if none does). ``put(obj, timeout=t)`` waits at
        most ``t`` seconds in all, for a consumer and for room, and raises ``Full`` (a
        ``queue.Full``) when the time runs out; ``put(obj, block=False)`` waits for neither and
        raises ``Full`` at once. Nothing was sent when ``Full`` is raised.

        If the consumer died and another process took the queue over (its first ``get``), ``put``
        connects to the new one, waiting as above (up to ``timeout`` if given, else
        ``connect_timeout``; ``Disconnected`` if none comes): messages put around the old
        consumer's death (until this process's channel noticed it gone) may be lost with it, and
        the one whose send found it gone is sent again, once, to the new consumer (at least once:
        the old one may have received it too)."""
        self._own_process()
        timeout = _seconds(timeout, "timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        sender = self._sender if self._sender is not None else self._open_sender(None, block, deadline)
        try:
            self._send(sender, obj, block, deadline, stream)
        except Disconnected:
            # The consumer is gone: reach the one that takes over, and send this message again once.
            sender = self._open_sender(sender, block, deadline)
            self._send(sender, obj, block, deadline, stream)

    def _send(self, sender: _native.Sender, obj: Any, block: bool, deadline: float | None, stream: Any) -> None:
        try:
            if not block:
                sender.try_send(obj)
            else:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                sender.send(obj, timeout=left, stream=stream)
        except Timeout:
            raise Full("the queue stayed full") from None

    def put_nowait(self, obj: Any) -> None:
        """``put(obj, block=False)``: ``Full`` at once if the queue is full or no consumer has
        taken it yet."""
        self.put(obj, block=False)

    def _open_sender(self, dead: _native.Sender | None, block: bool, deadline: float | None) -> _native.Sender:
        """This process's sender, connected if it is ``dead`` (``None``: never connected yet)."""
        with self._opening_sender:
            if self._sender is not dead and self._sender is not None:
                return self._sender  # another thread connected meanwhile
            if dead is not None:
                dead.close()
                self._sender = None
            if not block:
                deadline = time.monotonic()  # one attempt
            sender = self._connect(time.monotonic() + self._connect_timeout if deadline is None else deadline)
            if sender is None:
                if dead is not None:
                    raise Disconnected(f"the consumer of {self._address} is gone and no other took the queue in time")
                if deadline is None:
                    raise Disconnected(f"no consumer took {self._address} within {self._connect_timeout} s")
                raise Full(f"no consumer has taken the queue yet ({self._address}); nothing was sent")
            self._sender = sender
            return sender

    def _connect(self, deadline: float) -> _native.Sender | None:
        """A sender connected to the consumer, or ``None`` if none took the address by ``deadline``
        (one attempt when it has passed)."""
        while True:
            try:
                left = deadline - time.monotonic()
                # At least 10 ms for the greeting's round trip, so that a put_nowait or a short
                # timeout keeps its promise against a consumer that is alive but not answering.
                return _native.Sender.connect(self._address, timeout=min(10.0, max(0.01, left)))
            except Exception as error:  # noqa: BLE001 - sorted by _no_consumer
                if not _no_consumer(error):
                    raise
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next message; raises ``Empty`` (a ``queue.Empty``) when none came within
        ``timeout`` seconds (at once when ``block`` is false). Makes this process the consumer."""
        self._own_process()
        timeout = _seconds(timeout, "timeout")
        if self._receiver is None:
            with self._opening_receiver:
                if self._receiver is None:
                    self._receiver = self._claim()
        deadline = None if timeout is None else time.monotonic() + timeout
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
        """Closes this process's ends of the queue. A consumer stays the consumer (a later ``get``
        binds again) until it exits."""
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
