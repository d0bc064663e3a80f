"""A fault-injecting TCP proxy on loopback, between the limiter and redis-server.

Used by ``bench/faults.py`` and ``tests/resilience/test_fault_harness.py``. It forwards every byte
both ways, and on request:

- **delays** what the server sends back: each chunk read from the server is delivered to the
  client ``uniform(low, high)`` seconds later (a seeded RNG), in order; a round trip then takes the
  delay on top of its own time, as with a congested or distant Redis;
- goes **down**: every open connection is reset (RST, ``SO_LINGER`` 0) and every new one is
  accepted and reset at once, until it is set up again (flapping is the caller switching this
  every few milliseconds);
- **resets** every open connection once (:meth:`FaultProxy.reset_all`), as a middlebox or a
  failover would;
- **loses replies**: the next ``n`` chunks the server sends are thrown away and their connection
  reset (:meth:`FaultProxy.lose_replies`): the server ran the command, the client never hears.

One asyncio event loop in one daemon thread; the methods are thread-safe. Nothing listens beyond
127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["FaultProxy"]

_CHUNK = 65536


@dataclass(eq=False)
class _Link:
    """One client connection and its connection to the server."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a RST, not a FIN: the peer's next read or write fails at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Listens on ``127.0.0.1:<port>`` (a free port unless given) and forwards to
    ``upstream_host:upstream_port``; see the module docstring."""

    def __init__(
        self,
        upstream_port: int,
        *,
        upstream_host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._port = port
        self._rng = random.Random(seed)
        self._delay = (0.0, 0.0)
        self._down = False
        self._lose = 0
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        #: ``connections`` (accepted and forwarded), ``refused`` (accepted and reset while down),
        #: ``resets`` (open connections reset), ``delayed`` (chunks delivered late), ``lost``
        #: (replies thrown away), ``upstream failed`` (the server refused the proxy's connection).
        self.stats: Counter[str] = Counter()

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, "127.0.0.1", self._port)
                )
                self._port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # reported to start()'s caller
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            self._reset_links()
            await asyncio.sleep(0)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._port}/0"

    # -- faults ----------------------------------------------------------------------------

    def set_delay(self, low: float, high: float | None = None) -> None:
        """Deliver each chunk from the server ``uniform(low, high)`` seconds late (0: none)."""
        self._delay = (low, low if high is None else high)

    def set_down(self, down: bool) -> None:
        """Down: reset every open connection and every new one; up: forward again."""
        self._down = down
        if down:
            self._call(self._reset_links)

    def reset_all(self) -> int:
        """Reset every open connection now; answer how many there were."""
        return self._call(self._reset_links)

    def lose_replies(self, n: int) -> None:
        """Throw away the next ``n`` chunks the server sends, resetting each one's connection."""
        self._lose = n

    def open_connections(self) -> int:
        return len(self._links)

    # -- internals -------------------------------------------------------------------------

    def _call(self, fn: object) -> int:
        loop = self._loop
        assert loop is not None, "start() the proxy first"

        async def run() -> int:
            return fn()  # type: ignore[operator, no-any-return]

        return asyncio.run_coroutine_threadsafe(run(), loop).result(5)

    def _reset_links(self) -> int:
        links = list(self._links)
        for link in links:
            self.stats["resets"] += 1
            _reset(link.client)
            if link.server is not None:
                _reset(link.server)
            for task in link.tasks:
                task.cancel()
        self._links.clear()
        return len(links)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._down:
            self.stats["refused"] += 1
            _reset(writer)
            return
        link = _Link(writer)
        self._links.add(link)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            self.stats["upstream failed"] += 1
            self._links.discard(link)
            _reset(writer)
            return
        if link not in self._links:  # reset while connecting
            _reset(up_writer)
            return
        link.server = up_writer
        self.stats["connections"] += 1
        link.tasks = [
            asyncio.create_task(self._pump(reader, up_writer, delayed=False)),
            asyncio.create_task(self._pump(up_reader, writer, delayed=True, link=link)),
        ]
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(link.tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in link.tasks:
            task.cancel()
        if link in self._links:  # one side closed: close the other (a FIN, data delivered)
            self._links.discard(link)
            for side in (writer, up_writer):
                with contextlib.suppress(Exception):
                    side.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        delayed: bool,
        link: _Link | None = None,
    ) -> None:
        if not delayed:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await reader.read(_CHUNK):
                    writer.write(data)
                    await writer.drain()
            return
        # Server -> client: each chunk held until its delivery time, in order.
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(queue, writer))
        last = 0.0
        try:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await reader.read(_CHUNK):
                    if self._lose > 0 and link is not None:  # a reply lost in transit
                        self._lose -= 1
                        self.stats["lost"] += 1
                        self._links.discard(link)
                        _reset(link.client)
                        if link.server is not None:
                            _reset(link.server)
                        return
                    low, high = self._delay
                    wait = self._rng.uniform(low, high) if high > 0 else 0.0
                    last = max(last, time.monotonic() + wait)
                    queue.put_nowait((last, data))
            queue.put_nowait((last, b""))  # end of stream, after what is pending
            await deliver
        finally:
            deliver.cancel()

    async def _deliver(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(OSError):
            while True:
                at, data = await queue.get()
                wait = at - time.monotonic()
                if wait > 0:
                    self.stats["delayed"] += 1
                    await asyncio.sleep(wait)
                if not data:
                    return
                writer.write(data)
                await writer.drain()
