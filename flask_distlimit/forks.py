"""What a forked child does again: the live objects of one kind, each reset in the child.

Each kind of object that must not share its connections, locks or counters with the parent
keeps an :class:`AfterFork` and adds every instance to it; ``os.register_at_fork`` resets each
in the child. :func:`warn_if_uwsgi_skips_fork_hooks` warns when uWSGI will not run these hooks
(docs/design-notes.md, "Forked workers and uWSGI").
"""

from __future__ import annotations

import importlib
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Final, Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Values uWSGI reads as "off" for an on/off option (``uwsgi_opt_true``), in any case.
_OFF: Final = frozenset({"false", "off", "no", "0"})
#: The pid of the process that has logged the uWSGI warning (one line per process).
_warned_in: int | None = None


class AfterFork(Generic[T]):
    """The live instances of one kind, ``reset(instance)`` for each in a forked child; held by
    weak reference, so being registered keeps none alive."""

    def __init__(self, reset: Callable[[T], None]) -> None:
        self._members: weakref.WeakSet[T] = weakref.WeakSet()
        self._reset = reset
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.in_child)

    def add(self, member: T) -> None:
        self._members.add(member)

    def in_child(self) -> None:
        """What runs in a forked child (called by ``os.register_at_fork``)."""
        for member in list(self._members):
            self._reset(member)


def _option(options: Mapping[object, object], name: str) -> object:
    """The value of uWSGI option ``name`` in ``uwsgi.opt`` (``None`` when not given)."""
    return options.get(name, options.get(name.encode()))


def _on(options: Mapping[object, object], name: str) -> bool:
    """Is the on/off uWSGI option ``name`` on? (module docstring)"""
    value = _option(options, name)
    if isinstance(value, list | tuple):  # given several times: the last one wins
        value = value[-1] if value else None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str):
        return value.lower() not in _OFF
    return bool(value)


def uwsgi_skips_fork_hooks(uwsgi: object) -> str | None:
    """Why uWSGI (its ``uwsgi`` module) forks workers without running Python's fork hooks, or
    ``None`` when it runs them or loads the app after the fork (module docstring). Raises
    ``TypeError`` when ``uwsgi.opt`` is not a mapping."""
    options = getattr(uwsgi, "opt", None)
    if not isinstance(options, Mapping):
        raise TypeError(f"uwsgi.opt is {type(options).__name__}, not a mapping")
    if _on(options, "lazy-apps") or _on(options, "lazy"):
        return None
    if _on(options, "py-call-uwsgi-fork-hooks"):
        threads = getattr(uwsgi, "has_threads", None)
        if threads is None:
            threads = _on(options, "enable-threads") or _option(options, "threads") is not None
        if threads:
            return None
        return (
            "py-call-uwsgi-fork-hooks is set but threads are off, so uWSGI calls no fork hook "
            "(and ignores py-call-osafterfork)"
        )
    if _on(options, "py-call-osafterfork"):
        return None
    return "none of lazy-apps, py-call-osafterfork and py-call-uwsgi-fork-hooks is set"


def warn_if_uwsgi_skips_fork_hooks() -> None:
    """Log one WARNING per process when uWSGI runs this app without Python's fork hooks
    (module docstring). Called by ``init_app``; never raises."""
    global _warned_in
    if _warned_in == os.getpid():
        return
    try:
        reason = uwsgi_skips_fork_hooks(importlib.import_module("uwsgi"))
    except ImportError:  # only importable inside uWSGI
        return
    except Exception:  # never break an app's start for a warning
        log.debug("Could not read uWSGI's options", exc_info=True)
        return
    if reason is None:
        return
    _warned_in = os.getpid()
    log.warning(
        "uWSGI runs this app without Python's fork hooks (%s): a worker forked after the app "
        "was built keeps the rate limiter's state from the process it was forked from. Every "
        "worker then makes the same request tokens, so a call made again after its reply was "
        "lost can be answered with another worker's reply, and each keeps that process's quota "
        "leases (spent again by every worker), circuit breakers, locks and deny cache. Set "
        "lazy-apps = true (each worker builds the app after the fork) or "
        "py-call-osafterfork = true in the uWSGI configuration.",
        reason,
    )
