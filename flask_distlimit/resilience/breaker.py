"""The circuit breaker in front of the storage: stop asking a sick Redis, ask again later.

One :class:`Breaker` per process, app and storage node (owned by the guard's
:class:`~flask_distlimit.resilience.breakers.Breakers`). The caller asks :meth:`Breaker.allow`,
makes the call itself (outside any lock) and reports :meth:`~Breaker.success`,
:meth:`~Breaker.failure` or :meth:`~Breaker.release`. Only outages count; an error reply is an
answer. Closed, open for ``reset_timeout`` seconds of the injected ``clock``, then half-open with
exactly one trial. :data:`FAIL_MAX` and :data:`RESET_TIMEOUT` check the settings (a
:class:`~flask_distlimit.errors.ConfigurationError` naming the key). Transitions are logged
(logger ``flask_distlimit.breaker``). docs/failure-modes.md, "The circuit breaker", says more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final, Literal, cast

import pybreaker

from flask_distlimit.core.ranges import Range

log = logging.getLogger("flask_distlimit.breaker")  # a public name (docs/failure-modes.md), kept

#: pybreaker's own state names (``pybreaker.STATE_CLOSED``, ...), which its state storage keeps.
BreakerState = Literal["closed", "open", "half-open"]

#: ``fail_max`` (``DISTLIMIT_BREAKER_FAIL_MAX``) and ``reset_timeout``
#: (``DISTLIMIT_BREAKER_RESET_TIMEOUT``): what each accepts.
FAIL_MAX: Final = Range(
    True, 1, 10_000, " (consecutive storage outages that open the circuit breaker; default 5)"
)
RESET_TIMEOUT: Final = Range(
    False,
    0,
    3600,
    " seconds (how long the breaker stays open before a trial call; default 30)",
    strict=True,
)


class _Listener(pybreaker.CircuitBreakerListener):
    """Logs state changes and forwards them to the breaker's ``on_change`` hook."""

    def __init__(self, owner: Breaker) -> None:
        self._owner = owner

    def state_change(self, cb: Any, old_state: Any, new_state: Any) -> None:
        new = str(new_state.name)  # pybreaker notifies changes only: old_state is never None
        owner = self._owner
        owner.calm = new == "closed"  # closing reset the counter (also a change made directly)
        if new == "open":
            log.warning(
                "Rate-limit storage %s is unavailable after %s: circuit breaker %s opened; "
                "applying the failure policy for %.3g s before a trial call (last error: %s)",
                owner.name,
                "its trial call failed"  # one failure, in a half-open breaker
                if old_state.name == "half-open"
                else f"{owner.fail_max} consecutive failure(s)",
                owner.name,
                owner.reset_timeout,
                owner.last_error,
            )
        elif new == "closed":
            log.info("Rate-limit storage %s answers again: circuit breaker closed", owner.name)
        elif new == "half-open":
            log.info("Circuit breaker %s half-open: trying the storage once", owner.name)
        if owner.on_change is not None:
            owner.on_change(new)  # type: ignore[arg-type]


class Breaker:
    """A circuit breaker whose protected calls run outside its lock.

    Why pybreaker's state but not its ``call()``: ``call()`` holds one lock for the whole
    protected call (every Redis round trip of a gthread worker would wait for the previous one),
    and its open state is timed on ``datetime.now()``, which tests cannot inject. So pybreaker
    keeps the state, counter and listeners (public API only); the timing and the trial are here.

    ``clock`` is a monotonic clock in seconds (tests inject a fake one). ``on_change`` is called
    with the new state name after every transition (used for the metrics gauge).
    """

    def __init__(
        self,
        *,
        fail_max: int = 5,
        reset_timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "storage",
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self.fail_max = int(FAIL_MAX.read("DISTLIMIT_BREAKER_FAIL_MAX", fail_max))
        self.reset_timeout = RESET_TIMEOUT.read("DISTLIMIT_BREAKER_RESET_TIMEOUT", reset_timeout)
        self.name = name
        self.on_change = on_change
        self.last_error: BaseException | None = None
        #: closed, and no outage counted since the last answer: :meth:`allow` says yes and
        #: :meth:`success` changes nothing, so a caller may skip both (one read, no call)
        self.calm = True
        self._clock = clock
        self._lock = threading.Lock()
        self._store = pybreaker.CircuitMemoryStorage("closed")
        self._cb = self._circuit([_Listener(self)])
        self._opened_at = 0.0  # clock() when last opened
        self._trial_since: float | None = None  # clock() when the running trial began

    # -- state -------------------------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        return cast(BreakerState, self._store.state)

    @property
    def failures(self) -> int:
        """Consecutive outages counted while closed."""
        return int(self._store.counter)

    @property
    def circuit_breaker(self) -> pybreaker.CircuitBreaker:
        """The underlying pybreaker breaker (state, counter and listeners live there)."""
        return self._cb

    def opened_for(self) -> float | None:
        """Seconds since the breaker opened, or ``None`` when it is closed."""
        if self._store.state == "closed":
            return None
        return self._clock() - self._opened_at

    # -- the protocol around a call ----------------------------------------------------------

    def allow(self) -> bool:
        """May the caller try the storage now? ``False``: apply the failure policy instead.

        A ``True`` obliges the caller to report :meth:`success` or :meth:`failure` (or
        :meth:`release` when the call ended in an unrelated exception).
        """
        if self._store.state == "closed":  # the hot path: one attribute read, no lock
            return True
        now = self._clock()
        with self._lock:
            state = self._store.state
            if state == "closed":
                return True
            if state == "open":
                if now - self._opened_at < self.reset_timeout:
                    return False
                self._trial_since = now
                self._cb.half_open()
                return True
            # half-open: one trial at a time; a trial that never reported is given up
            if self._trial_since is not None and now - self._trial_since < self.reset_timeout:
                return False
            self._trial_since = now
            return True

    def success(self) -> None:
        """The storage answered (a value or an error reply)."""
        if self.calm:  # the hot path
            return
        with self._lock:
            if self._store.state == "closed":
                self._store.reset_counter()
            else:
                self._trial_since = None
                self.last_error = None
                self._cb.close()
            self.calm = True

    def failure(self, error: BaseException) -> None:
        """The storage could not be reached (an outage)."""
        now = self._clock()
        with self._lock:
            self.calm = False
            self.last_error = error
            store = self._store
            state = store.state
            if state == "closed":
                store.increment_counter()
                if store.counter < self.fail_max:
                    return
            elif state == "open":
                return  # a call that started before the breaker opened
            self._trial_since = None
            self._opened_at = now
            self._cb.open()

    def release(self) -> None:
        """The call ended in neither an answer nor an outage (e.g. an unrelated exception):
        free the half-open trial slot without deciding anything."""
        if self._store.state != "half-open":
            return
        with self._lock:
            self._trial_since = None

    def reset(self) -> None:
        """Close the breaker and forget the failures (tests, manual recovery)."""
        with self._lock:
            self._trial_since = None
            self.last_error = None
            if self._store.state != "closed":
                self._cb.close()
            self._store.reset_counter()
            self.calm = True

    def _circuit(self, listeners: Any) -> pybreaker.CircuitBreaker:
        """A pybreaker breaker on this breaker's state storage (built on an existing storage,
        it takes the state without notifying anyone)."""
        return pybreaker.CircuitBreaker(
            fail_max=self.fail_max,
            reset_timeout=self.reset_timeout,
            state_storage=self._store,
            listeners=listeners,
            name=self.name,
        )

    def _after_fork(self) -> None:
        # A lock copied from the parent may be held by a thread that does not exist here: ours
        # is replaced, and so is pybreaker's breaker (whose own lock open()/close() take), by a
        # new one on the same state storage and listeners (public constructor and properties).
        self._lock = threading.Lock()
        self._cb = self._circuit(self._cb.listeners)  # a tuple of the same listeners
        self._trial_since = None

    def __repr__(self) -> str:
        return f"<Breaker {self.name} {self.state} failures={self.failures}/{self.fail_max}>"
