"""Many calls in flight, few connections: the script calls of concurrent requests share one write.

A call finds fewer than ``width`` batches in flight and **leads**: it takes a connection and every
call queued meanwhile (up to ``max_batch``), sends them in one write, reads one reply per call in
order and hands each its own, then hands the connection to the oldest call queued since (or gives
it back); else it **follows**, queued until answered or handed the connection to lead.

Promises: each call gets its own reply or its own error (one call's ``NOSCRIPT`` or ``WRONGTYPE``
is its alone); every call's Redis deadline runs from its batch's send, a wait before it being this
process's load, bounded by ``wait_until`` (then :class:`~.pool.NoConnectionAvailable`), until
Redis is seen late (:attr:`Pipeline.late`): then a call's whole wait ends by one timeout from its
ask, a call not sent by then answered with a timeout; a batch is
sent twice only when its send failed; after a reply lost under the batch every unanswered call is
told so (:attr:`Call.lost`); no thread, no timer; gevent-safe through monkey-patched locks; a
forked child starts with an empty queue. Design: docs/design-notes.md, "The pipeline".
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import redis
from redis.exceptions import NoScriptError

from flask_distlimit.storage.pool import DeadlinePool, NoConnectionAvailable

#: Batches in flight at once per pipeline (each on a connection of its own).
DEFAULT_WIDTH: Final = 4
#: The most calls in one batch: Redis runs a batch's scripts one after another (about 30 us
#: each), so a batch's last reply comes at most a few milliseconds after its first.
DEFAULT_MAX_BATCH: Final = 128

_QUEUED, _TAKEN, _LEAD, _DONE = range(4)


def script_load(source: str) -> Callable[[Any], bytes]:
    """A pipeline's ``load`` for the script ``source``: its ``SCRIPT LOAD``, packed by the first
    connection that asks (its encoder), then kept."""
    packed: list[bytes] = []

    def load(connection: Any) -> bytes:
        if not packed:
            packed.append(b"".join(connection.pack_command("SCRIPT", "LOAD", source)))
        return packed[0]

    return load


#: A call's reply before one is read.
_UNREAD: Final = object()


class Call:
    """One request's packed script call, and how it ended.

    After :meth:`Pipeline.call`: ``reply`` (when ``error`` is ``None``), else ``error``: an
    error reply (a ``redis.ResponseError``, read whole), or a failure; ``lost`` when the
    connection was closed after the send (the script may have run: make it again as a repeat);
    ``deadline``, the Redis deadline of the batch it went in (for a repeat).
    """

    command: bytes
    asked = 0.0  # when it queued (a call that leads at once: when Redis is late)
    reply: Any = _UNREAD
    error: BaseException | None = None
    lost = False
    deadline = 0.0
    state = _QUEUED
    connection: Any = None  # handed to a follower promoted to lead
    wake: Any = None  # a held lock a follower waits on


class Pipeline:
    """Batches the calls of one pool's connections (module docstring).

    ``load`` packs the script's ``SCRIPT LOAD`` for a connection (its encoder); ``trouble`` is
    called when a connection failed under a batch (the storage arms its request tokens).
    """

    def __init__(
        self,
        pool: DeadlinePool,
        *,
        load: Callable[[Any], bytes],
        trouble: Callable[[], None] = lambda: None,
        width: int = DEFAULT_WIDTH,
    ) -> None:
        self.pool = pool
        self.width = max(1, min(width, pool.max_connections))
        self.max_batch = DEFAULT_MAX_BATCH  #: the most calls one batch takes
        #: packs the script's ``SCRIPT LOAD`` for a connection
        self.load = load
        self._trouble = trouble
        #: the script is known loaded (else the next batch sends ``SCRIPT LOAD`` first)
        self.loaded = False
        #: Redis was seen late: the last batch timed out, or its socket was empty half a
        #: timeout after its send; then a call's whole wait counts against its one deadline
        self.late = False
        self.reset()

    def reset(self) -> None:
        """An empty queue and no batch in flight (a new pipeline, or a forked child's)."""
        self._lock = threading.Lock()
        self._queue: deque[Call] = deque()
        self._leading = 0  # batches in flight: calls leading one
        self.pid = os.getpid()

    # -- a call --------------------------------------------------------------------------------

    def call(self, command: bytes, wait_until: float) -> Call:
        """Send ``command`` (one packed ``EVALSHA``) in a batch and wait for its reply; a wait
        for a batch ends by ``wait_until`` (the queue budget), then
        :class:`~.pool.NoConnectionAvailable` is raised. The answer is on the returned
        :class:`Call`. A leader sends its batch and reads the replies (:meth:`_run`)."""
        if self.pid != os.getpid():
            self.reset()
        call = Call()  # its fields start at the class's defaults
        call.command = command
        with self._lock:
            if self._leading < self.width:
                self._leading += 1
                call.state = _LEAD
            else:
                call.asked = time.monotonic()
                call.wake = threading.Lock()
                call.wake.acquire()
                self._queue.append(call)
        pool = self.pool
        batch = [call]
        connection = None
        leading = call.state == _LEAD
        try:
            if not leading:  # it follows: until answered or handed the lead
                if not call.wake.acquire(timeout=max(0.0, wait_until - time.monotonic())):
                    with self._lock:
                        if call.state == _QUEUED:  # never taken: it leaves, nothing was sent
                            self._queue.remove(call)
                            call.state = _DONE
                            raise NoConnectionAvailable("No batch took the call in time.")
                    # taken into a batch (or handed the lead) meanwhile: its leader answers it
                    call.wake.acquire()
                if call.state != _LEAD:  # answered by its batch's leader
                    return call
                leading = True
            # It leads a batch: on the connection handed over (or one from the pool), then
            # hands the connection to the next queued call, or gives it back (finally:).
            connection = call.connection
            call.connection = None
            due = None
            if self.late:  # the batch answers by its oldest call's deadline (the leader's)
                call.asked = call.asked or time.monotonic()
                due = call.asked + pool.timeout
            if connection is None:
                connection = pool.checkout(wait_until, probe=False, connect_by=due)
            else:
                pool.ready(connection, due)
            with self._lock:  # the calls queued meanwhile, up to max_batch, are taken
                queue = self._queue
                while queue and len(batch) < self.max_batch:
                    taken = queue.popleft()
                    taken.state = _TAKEN
                    batch.append(taken)
            todo = batch
            if due is not None:
                todo = self._expire(batch)
                if not todo:
                    return call
                due = todo[0].asked + pool.timeout
            self._run(connection, todo, due)
        except BaseException as exc:
            if not leading:
                # A follower's own: interrupted while it waited (a signal handler's exception,
                # a gevent Timeout), it leaves the queue; a lead handed to it meanwhile goes on
                # below; a batch that took it answers nobody.
                with self._lock:
                    if call.state == _QUEUED:
                        self._queue.remove(call)
                raise
            if connection is not None:
                pool.broken(connection)  # a reply may be left unread
            if isinstance(exc, redis.TimeoutError):
                self.late = True
            self._fail(batch, exc)
            if not isinstance(exc, Exception):
                raise  # an interrupt of the leader's own (a signal handler's, a timeout's)
        finally:
            # Led, or handed the lead and interrupted before it led (the connection still on
            # the call): the connection goes to the oldest queued call (it leads next), or back
            # to the pool; a lead never lost, or the pipeline would lose a connection for good.
            if call.state == _LEAD:
                for follower in batch[1:]:  # each is answered (a batch of one wakes nobody)
                    follower.state = _DONE
                    follower.wake.release()
                if connection is None:
                    connection = call.connection
                with self._lock:
                    nxt = self._queue.popleft() if self._queue else None
                    if nxt is None:
                        self._leading -= 1
                    else:
                        nxt.state = _LEAD
                        nxt.connection = connection
                if nxt is not None:
                    nxt.wake.release()
                elif connection is not None:
                    pool.release(connection)
        return call

    def _expire(self, batch: list[Call]) -> list[Call]:
        """Redis late: the calls of ``batch`` whose deadline has passed are answered with a
        timeout, unsent; the others, oldest first."""
        now = time.monotonic()
        sent = []
        for call in batch:
            if call.asked + self.pool.timeout > now:
                sent.append(call)
            else:
                call.error = redis.TimeoutError(
                    "Timeout: Redis was late and this call waited its whole deadline "
                    "(DISTLIMIT_REDIS_TIMEOUT) for a batch; it was not sent"
                )
        return sent

    def _run(self, connection: Any, batch: list[Call], due: float | None) -> None:
        """Send ``batch`` in one write, read one reply per call by ``due``, the oldest call's
        deadline (but a moment after the send at least), else a timeout after the send. The
        calls answered ``NOSCRIPT`` are sent once more behind a ``SCRIPT LOAD``, in one write;
        a second ``NOSCRIPT`` is their error."""
        pool = self.pool
        load = None if self.loaded else self.load(connection)
        payload = batch[0].command if len(batch) == 1 else b"".join([c.command for c in batch])
        if load is not None:
            payload = load + payload
        try:
            pool.send(connection, [payload])
        except redis.ConnectionError:
            # Redis never had the whole write: nothing ran. Once more on a fresh connection.
            self._trouble()
            pool.renew(connection, time.monotonic() + pool.timeout)
            pool.send(connection, [payload])
        sent = time.monotonic()
        deadline = sent + pool.timeout  # Redis's time starts once it has them
        if due is not None:
            deadline = min(deadline, max(due, sent + pool.slack))
        # calls in flight beside this one (a queue forms only then): is Redis late?
        watched = self._leading > 1 or len(batch) > 1 or bool(self._queue)
        if watched:  # Redis is late when its first reply is not there half a timeout after
            # the send (a reader that came late, for the GIL, finds one that came in time)
            try:
                self.late = not connection.can_read(
                    max(0.0, sent + pool.timeout / 2 - time.monotonic())
                )
            except redis.ConnectionError as exc:
                pool.broken(connection)
                self._lost(batch, exc, deadline)
                return
        todo, again = batch, False
        while True:
            if load is not None:
                # the SCRIPT LOAD's reply: an error reply (an ACL without SCRIPT LOAD) is left
                # to the calls' own replies to tell
                try:
                    pool.read(connection, deadline)
                except redis.ResponseError:
                    pass
                except redis.ConnectionError as exc:
                    self._lost(todo, exc, deadline)
                    return
                self.loaded = True
            missing: list[Call] = []
            for n, call in enumerate(todo):
                call.deadline = deadline
                try:
                    call.reply = pool.read(connection, deadline)
                except NoScriptError as exc:
                    if again:
                        call.error = exc
                    else:
                        missing.append(call)
                except redis.ResponseError as exc:
                    call.error = exc  # read whole: the next reply is the next call's
                except redis.ConnectionError as exc:
                    self._lost(todo[n:], exc, deadline)
                    missing = []
                    break
            if (
                not again
                and not watched
                and self.late
                and time.monotonic() - sent < pool.timeout / 2
            ):
                self.late = False  # answered in time: Redis is not late (now)
            if not missing:
                return
            self.loaded = False
            load = self.load(connection)
            pool.send(connection, [load + b"".join([c.command for c in missing])])
            todo, again = missing, True

    def _lost(self, calls: list[Call], exc: redis.ConnectionError, deadline: float) -> None:
        """The connection closed under ``calls``, sent: each may have run."""
        self._trouble()
        for call in calls:
            call.error, call.lost, call.deadline = copy.copy(exc), True, deadline

    def _fail(self, batch: list[Call], exc: BaseException) -> None:
        """``exc`` ended the batch. An outage (a timeout, a send that failed twice) is the
        error of every call not answered; an interrupt of the leader (``batch[0]``, not an
        ``Exception``) leaves them lost (they may have run: each is made again) and is the
        leader's own."""
        interrupted = not isinstance(exc, Exception)
        for call in batch:
            if call.error is None and call.reply is _UNREAD:  # not answered
                if interrupted:
                    call.error = redis.ConnectionError(f"the batch was interrupted: {exc!r}")
                    call.lost = True
                else:
                    call.error = copy.copy(exc)  # each raises its own
        if interrupted:
            batch[0].error, batch[0].lost = exc, False
