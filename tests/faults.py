"""Load and measurement helpers of the fault-injection tests (tests/resilience/test_faults*.py) and
of bench/bench_failure.py: a few threads calling one request function in a loop, timestamped; and
:class:`FailingStorage`, a storage that fails the calls a test picks
(tests/defences/test_fleet_bound.py); and :class:`DelayingProxy`, a TCP proxy that holds every
reply for a while (tests/storage/test_deadline.py, tests/storage/test_pipeline.py)."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import redis

from flask_distlimit.core.decision import Check, Evaluation
from flask_distlimit.errors import StorageUnavailable
from flask_distlimit.resilience.guard import Guard
from flask_distlimit.resilience.outcome import Outcome
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.heartbeat import Fleet

__all__ = [
    "OPENED",
    "FailingStorage",
    "Load",
    "Sample",
    "Switch",
    "cut_under_the_request",
    "kind_of",
    "opened",
    "percentile",
    "wait_until",
]

#: Storages tests opened through :func:`opened`; tests/conftest.py closes them after each test.
OPENED: list[Storage] = []


def opened(storage: Storage) -> Storage:
    """``storage``, closed after the test that opened it (by tests/conftest.py)."""
    OPENED.append(storage)
    return storage


@dataclass(frozen=True, slots=True)
class Sample:
    started: float  # time.monotonic()
    latency: float  # seconds
    kind: str  # "allowed", "denied", "degraded allowed", "degraded denied", "unavailable", "error"


def kind_of(outcome: Outcome) -> str:
    """A short name for what a guarded call answered."""
    if outcome.unavailable:
        return "unavailable"
    prefix = "degraded " if outcome.degraded else ""
    if outcome.evaluation is None:
        return prefix + "allowed"
    return prefix + ("allowed" if outcome.evaluation.allowed else "denied")


class Load:
    """``threads`` threads each calling ``request()`` (which answers a kind) until stopped,
    ``pause`` seconds apart; an exception is recorded as kind ``error`` (a 5xx)."""

    def __init__(
        self, request: Callable[[int], str], *, threads: int = 4, pause: float = 0.002
    ) -> None:
        self.request = request
        self.threads = threads
        self.pause = pause
        self.samples: list[Sample] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def _run(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            started = time.monotonic()
            try:
                kind = self.request(n * 1_000_000 + i)
            except Exception as exc:  # recorded, asserted on by the tests
                kind = "error"
                self.errors.append(exc)
            self.samples.append(Sample(started, time.monotonic() - started, kind))
            time.sleep(self.pause)

    def __enter__(self) -> Load:
        self._workers = [
            threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=30)

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in list(self.samples) if start <= s.started <= end]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def wait_until(condition: Callable[[], bool], timeout: float, step: float = 0.01) -> float:
    """Poll ``condition`` until true; answer the seconds it took, or raise after ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - started


def guard_request(
    guard: Guard, key: str = "ratelimit:{load}:route:fixed_window"
) -> Callable[[int], str]:
    """A request function for :class:`Load`: one generous fixed-window check through ``guard``."""
    checks = [Check(key=key, algorithm="fixed_window", limit=10**9, period=60)]

    def request(_: int) -> str:
        return kind_of(guard.evaluate(checks))

    return request


class Switch:
    """A ``fails`` of :class:`FailingStorage`: every call fails while ``down``."""

    def __init__(self, *, down: bool = False) -> None:
        self.down = down

    def __call__(self, _: int) -> bool:
        return self.down


class FailingStorage(Storage):
    """Forwards to ``inner``, except the calls ``fails(n)`` picks (``n``: this wrapper's call
    count from 0), which raise :class:`StorageUnavailable` without reaching ``inner``: a storage
    that fails every other call, in bursts of the test's clock, or at random from a seed."""

    def __init__(self, inner: Storage, fails: Callable[[int], bool]) -> None:
        self.inner = inner
        self.fails = fails
        self.scheme = inner.scheme
        self.calls = 0
        self.failed = 0

    def _gate(self) -> None:
        n, self.calls = self.calls, self.calls + 1
        if self.fails(n):
            self.failed += 1
            raise StorageUnavailable(f"injected failure of call {n}")

    def evaluate(self, checks: Sequence[Check], *, now_us: int | None = None) -> Evaluation:
        self._gate()
        return self.inner.evaluate(checks, now_us=now_us)

    def heartbeat(self, key: str, member: str, ttl: float) -> int:
        self._gate()
        return self.inner.heartbeat(key, member, ttl)

    def heartbeat_fleet(self, key: str, member: str, ttl: float, known: int = 0) -> Fleet:
        self._gate()
        return self.inner.heartbeat_fleet(key, member, ttl, known)

    def ping(self) -> float:
        return self.inner.ping()

    def scan(self, match: str) -> Iterator[str]:
        return self.inner.scan(match)

    def delete(self, keys: Iterable[str]) -> int:
        return self.inner.delete(keys)

    def close(self) -> None:
        self.inner.close()


def cut_under_the_request(admin: redis.Redis) -> threading.Thread:
    """Hold writes on ``admin``'s server, then, once a script call is held there, close every
    other client's connection (before the script ran) and let writes go again; answers the
    thread doing it (join it)."""
    admin.execute_command("CLIENT", "PAUSE", 2000, "WRITE")

    def cut() -> None:
        for _ in range(200):  # until the script is held (it shows as a blocked client)
            if int(admin.info("clients").get("blocked_clients", 0)) or any(
                c.get("cmd") == "evalsha" for c in admin.client_list()
            ):
                break
            threading.Event().wait(0.01)
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        admin.execute_command("CLIENT", "UNPAUSE")

    thread = threading.Thread(target=cut)
    thread.start()
    return thread


class DelayingProxy:
    """A TCP proxy to ``port`` that forwards requests at once and each reply after ``delay``,
    and while ``released`` is clear, only once it is set (a test holds replies as long as it
    needs, then lets them go)."""

    def __init__(self, port: int, delay: float) -> None:
        self.target = ("127.0.0.1", port)
        self.delay = delay
        self.released = threading.Event()
        self.released.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        self._lock = threading.Lock()  # a connection accepted as the proxy closes is closed too
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self.sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                if replies:
                    time.sleep(self.delay)  # read now: a test may change it on a live connection
                    self.released.wait()
                    data += _more(source)  # what came meanwhile: delayed once, not again
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self.sockets)
        for sock in sockets:
            sock.close()


def _more(source: socket.socket) -> bytes:
    """What ``source`` holds now, without waiting."""
    source.setblocking(False)
    data = b""
    try:
        while more := source.recv(65536):
            data += more
    except BlockingIOError:
        pass
    finally:
        source.setblocking(True)
    return data
