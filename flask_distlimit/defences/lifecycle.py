"""What a request takes, and the one release that gives it all back when its body is sent.

A request's *holdings* (a place in flight, concurrency and fleet slots) are kept in one
:class:`Ledger` in its WSGI environ; :meth:`Ledger.end` releases them all, exactly once.
:class:`Lifecycle`, around ``app.wsgi_app``, ends the ledger when the server has written the
body, however the response ends (docs/design-notes.md, "The request's ledger"), and appends the
rate-limit headers ``after_request`` left in the environ (``headers_key``) as the response
starts.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment
    from flask import Flask


log = logging.getLogger("flask_distlimit")

_FILE_WRAPPER: Final = "wsgi.file_wrapper"


class Holding(Protocol):
    """Something a request took: given back once by :meth:`release`, kept by :meth:`renew`."""

    def release(self) -> None: ...

    def renew(self) -> None: ...


class Ledger:
    """One request's holdings, released together, once (see the module docstring)."""

    def __init__(self, clock: Callable[[], int], renew_every_us: int) -> None:
        self._clock = clock
        self._renew_every = renew_every_us
        self._renew_at = clock() + renew_every_us
        self._holdings: list[Holding] = []
        self._lock = threading.Lock()
        #: the holdings were released (or the end passed with none)
        self.ended = False
        #: the server's file wrappers made around a proxy of ours while the app ran, each with
        #: its proxy
        self.files: list[tuple[object, _ClosingFile]] = []

    def take(self, holding: Holding) -> None:
        """Keep ``holding`` until the end (released at once if the end has passed)."""
        with self._lock:
            if not self.ended:
                self._holdings.append(holding)
                return
        _release(holding)

    def end(self) -> None:
        """Release every holding, once; never raises an :class:`Exception`. One interrupted
        by a ``BaseException`` (a gevent timeout) does not keep the others from release."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            holdings, self._holdings = self._holdings, []
        for n, holding in enumerate(holdings):
            try:
                _release(holding)
            except BaseException:
                for rest in holdings[n + 1 :]:
                    _release(rest)
                raise

    def end_after_closing(self, inner: object) -> None:
        """Close ``inner`` (the body or file the app made, when it has a ``close()``), then
        end, even when that close raised."""
        try:
            close = getattr(inner, "close", None)
            if close is not None:
                close()
        finally:
            self.end()

    def renew_if_due(self) -> None:
        """Renew every holding when half the lease has passed since they were taken or last
        renewed (called per chunk of a body: one clock read when nothing is due)."""
        now = self._clock()
        if now < self._renew_at:
            return
        self._renew_at = now + self._renew_every
        with self._lock:
            holdings = [] if self.ended else list(self._holdings)
        for holding in holdings:
            try:
                holding.renew()
            except Exception:
                log.exception("Renewing what a streamed request holds failed; it is not renewed.")


def _release(holding: Holding) -> None:
    try:
        holding.release()
    except Exception:  # after the response is made: never turn it into a 500
        log.exception("Giving back what a request held failed; its deadline gives it back.")


class _ClosingFile:
    """The file a ``send_file`` response hands the server's ``wsgi.file_wrapper``: every
    attribute is the file's (``fileno`` too, for ``sendfile(2)``), but ``close()`` also ends the
    request's ledger once its wrapper is the body the app returned (``is_body``; a file the
    view closes itself ends nothing), and ``read()`` renews what it holds."""

    def __init__(self, file: Any, ledger: Ledger) -> None:
        self._file = file
        self._ledger = ledger
        self.is_body = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def read(self, *args: Any) -> Any:
        self._ledger.renew_if_due()
        return self._file.read(*args)

    def close(self) -> None:
        if self.is_body:
            self._ledger.end_after_closing(self._file)
        elif hasattr(self._file, "close"):
            self._file.close()


_collecting = False  #: the garbage collector is running


def _gc_phase(phase: str, _info: dict[str, int]) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_gc_phase)


class _ClosingBody:
    """A response body whose ``close()`` (once) ends the request's ledger after the body's own
    ``close()``; its iterator ends the ledger once the server asks past the last chunk, and
    closes the body when let go of unfinished (into ``dropped`` when the garbage collector
    lets go). Each chunk renews what the request holds when that is due."""

    __slots__ = ("_body", "_closed", "_dropped", "_ledger")

    def __init__(self, body: Iterable[bytes], ledger: Ledger, dropped: list[_ClosingBody]) -> None:
        self._body = body
        self._ledger = ledger
        self._dropped = dropped
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        ledger = self._ledger
        try:
            for chunk in self._body:
                ledger.renew_if_due()
                yield chunk
        except GeneratorExit:  # let go of unfinished, and maybe never to be closed (asgiref)
            if _collecting:  # by the garbage collector, anywhere: no I/O (no lock) here
                self._dropped.append(self)
            else:
                self.close()
            raise
        except BaseException:  # the body raised: the server may never close it
            ledger.end()
            raise
        ledger.end()  # the server asked past the last chunk: every byte is written

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ledger.end_after_closing(self._body)


class Lifecycle:
    """The WSGI wrapper around one app's ``wsgi_app`` (see the module docstring)."""

    def __init__(self, clock: Callable[[], int], lease_seconds: int) -> None:
        self.wsgi_app: WSGIApplication  # the app's own, set by install()
        self._clock = clock
        self._renew_every = lease_seconds * 1_000_000 // 2
        self.key = f"flask_distlimit.ledger.{id(self):x}"
        #: the environ's list of the headers added to the response as it starts
        self.headers_key = f"flask_distlimit.headers.{id(self):x}"
        #: bodies the garbage collector let go of unclosed, closed when the next request comes
        self._dropped: list[_ClosingBody] = []

    def install(self, app: Flask, made: Callable[[WSGIEnvironment, bool], None] | None) -> None:
        """Wrap ``app.wsgi_app``; ``made(environ, raised)`` is called once the app has made
        each response (``raised``: the app raised instead)."""
        self.wsgi_app = app.wsgi_app
        self._made = made
        app.wsgi_app = self  # type: ignore[method-assign]

    def ledger(self, environ: WSGIEnvironment) -> Ledger:
        """The request's ledger, made on its first holding."""
        # outside the wrapper (a request context made by hand), a cell of its own: deadlines only
        cell: list[Ledger] = environ.setdefault(self.key, [])
        if cell:
            return cell[0]
        ledger = Ledger(self._clock, self._renew_every)
        cell.append(ledger)
        server_wrapper = environ.get(_FILE_WRAPPER)
        if server_wrapper is not None:
            # the server's own, around a file whose close() ends the ledger (_ClosingFile)
            def file_wrapper(file: Any, *args: Any, **kwargs: Any) -> object:
                proxy = _ClosingFile(file, ledger)
                made = server_wrapper(proxy, *args, **kwargs)
                ledger.files.append((made, proxy))
                return made

            environ[_FILE_WRAPPER] = file_wrapper
        return ledger

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        while self._dropped:
            try:
                dropped = self._dropped.pop()
            except IndexError:  # another thread took the last one
                break
            try:
                dropped.close()  # given back whatever its close() does
            except Exception:  # the app's close() of another request's body: not this one's 500
                log.exception(
                    "Closing a response body the garbage collector let go of raised; what its "
                    "request held is given back all the same."
                )
        # A cell, not the ledger: a middleware inside this wrapper that copies the environ
        # hands the app a copy that still holds this same cell.
        cell: list[Ledger] = []
        environ[self.key] = cell
        # the rate-limit headers, as after_request leaves them: appended as the response starts
        # (once, past werkzeug's checks of the app's own headers: our values are ours); not to
        # an error's own start (exc_info), nor our Retry-After (last) when the app set one
        added: list[tuple[str, str]] = []
        environ[self.headers_key] = added

        def start(status: str, headers: list[tuple[str, str]], *exc_info: Any) -> Any:
            if added and not exc_info:
                ours = added
                if ours[-1][0] == "Retry-After" and any(
                    n.lower() == "retry-after" for n, _ in headers
                ):
                    ours = ours[:-1]
                headers = [*headers, *ours]
            return start_response(status, headers, *exc_info)

        server_wrapper = environ.get(_FILE_WRAPPER)
        try:
            body = self.wsgi_app(environ, start)
        except BaseException:
            for ledger in cell:
                ledger.end()
            if self._made is not None:
                self._made(environ, True)
            raise
        finally:  # the server checks the body against its own wsgi.file_wrapper: put it back
            if cell and server_wrapper is not None:
                environ[_FILE_WRAPPER] = server_wrapper
        if self._made is not None:
            self._made(environ, False)
        if not cell or cell[0].ended:
            return body
        for made, proxy in cell[0].files:
            if body is made:  # the server's own file wrapper: its close() ends the ledger
                proxy.is_body = True
                return body
        return _ClosingBody(body, cell[0], self._dropped)
