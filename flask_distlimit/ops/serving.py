"""Who serves the app, with how many processes: ``memory://`` must not be split among several.

:func:`warn_if_memory_per_process`, called by ``init_app``, logs one WARNING per process, with the
fix, when ``memory://`` counts under several gunicorn or uWSGI workers. It runs once and never
raises. Design: docs/design-notes.md, "Who serves the app".
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flask_distlimit.storage.base import Storage

log = logging.getLogger("flask_distlimit.serving")  # a public name (docs/failure-modes.md), kept

#: The pid of the process that has logged the warning (one line per process).
_warned_in: int | None = None


@dataclass(frozen=True, slots=True)
class Server:
    """The server running this process: ``name`` and its worker ``processes`` (``None``:
    unknown, with the ``reason``)."""

    name: str
    processes: int | None
    reason: str = ""


def detect_server() -> Server | None:
    """The pre-forking server this process runs under (gunicorn or uWSGI), or ``None``."""
    if os.environ.get("SERVER_SOFTWARE", "").startswith("gunicorn"):
        return _gunicorn()
    try:
        uwsgi = importlib.import_module("uwsgi")  # only importable inside uWSGI
    except ImportError:
        return None
    numproc = getattr(uwsgi, "numproc", None)
    return _counted("uWSGI", numproc, "uwsgi.numproc is not a positive integer")


def _counted(name: str, processes: object, reason: str) -> Server:
    """``name`` with its ``processes`` if a positive integer, else unknown by ``reason``."""
    if isinstance(processes, int) and not isinstance(processes, bool) and processes > 0:
        return Server(name, processes)
    return Server(name, None, reason)


def _gunicorn() -> Server:
    program = Path(sys.argv[0] if sys.argv else "")
    if program.name != "gunicorn" and program.parts[-2:] != ("gunicorn", "__main__.py"):
        return Server("gunicorn", None, f"started by {sys.argv[0]!r}, not the gunicorn command")
    try:
        from gunicorn.app.wsgiapp import WSGIApplication
    except ImportError as exc:  # SERVER_SOFTWARE set by something else
        return Server("gunicorn", None, f"gunicorn is not importable ({exc})")
    printed = io.StringIO()
    try:
        with _undone_side_effects(), contextlib.redirect_stderr(printed):
            config = WSGIApplication("%(prog)s [OPTIONS] [APP_MODULE]", prog="gunicorn").cfg
            workers = config.workers
    except (Exception, SystemExit) as exc:  # gunicorn exits on a configuration it refuses
        log.debug("gunicorn's configuration could not be read: %r %s", exc, printed.getvalue())
        return Server("gunicorn", None, "its configuration could not be read")
    if printed.getvalue():
        log.debug("gunicorn printed while its configuration was read: %s", printed.getvalue())
    return _counted("gunicorn", workers, f"its workers setting is {workers!r}")


@contextlib.contextmanager
def _undone_side_effects() -> Iterator[None]:
    """Loading gunicorn's configuration changes to its ``chdir`` directory, may add it to
    ``sys.path`` and executes the config file as the module ``__config__``: undo all three."""
    cwd = os.getcwd()
    path = list(sys.path)
    missing = object()
    module = sys.modules.get("__config__", missing)
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        if module is missing:
            sys.modules.pop("__config__", None)
        else:
            sys.modules["__config__"] = module  # type: ignore[assignment]


def warn_if_memory_per_process(storage_url: str, storage: Storage | None = None) -> None:
    """Log one WARNING per process when ``memory://`` is served by several processes.

    ``storage`` is the ready storage an app passed (it wins over ``storage_url``, the value of
    ``DISTLIMIT_STORAGE_URL``). Never raises.
    """
    global _warned_in
    scheme = storage.scheme if storage is not None else storage_url.partition("://")[0].lower()
    if scheme != "memory" or _warned_in == os.getpid():
        return
    try:
        server = detect_server()
    except Exception:  # never break an app's start for a warning
        log.debug("Could not tell which server runs this process", exc_info=True)
        return
    if server is None or server.processes == 1:
        return
    _warned_in = os.getpid()
    if server.processes is None:
        served = (
            f"{server.name}, which may run several worker processes (their number is unknown: "
            f"{server.reason})"
        )
    else:
        served = f"{server.name} with {server.processes} worker processes"
    log.warning(
        "The rate-limit storage is memory:// and this app is served by %s. Each process keeps "
        "its own counters: with several, every limit is multiplied by the number of processes. "
        "Point DISTLIMIT_STORAGE_URL at a Redis all processes share, e.g. "
        "redis://localhost:6379/0 (memory:// is for tests and one-process development).",
        served,
    )
