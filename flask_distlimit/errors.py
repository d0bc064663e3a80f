"""The exceptions Flask-DistLimit raises.

One small hierarchy; catch the branch you can act on::

    DistLimitError
     ├── ConfigurationError      (also a ValueError) bad limit string, URL or DISTLIMIT_* value;
     │                           raised when the app is configured, never per request
     └── StorageError            the rate-limit store failed
          ├── StorageBusy            this process's own load: its limiter calls queued for a
          │                          connection (or the event loop, the GIL) past their queue
          │                          budget before anything was sent. Not an outage: the
          │                          breaker is not told, no failure policy applies; answered
          │                          503 with Retry-After: 1 (load shedding).
          ├── StorageUnavailable     an outage: connection refused or reset, timeout, cluster down,
          │    │                     Sentinel master not found. The circuit breaker counts these;
          │    │                     the failure policy answers the request.
          │    ├── StorageReplyLost   the server closed the connection after the request was
          │    │                     sent (a CLIENT KILL, an idle timeout, a proxy reset) but a
          │    │                     fresh connection answers: the store is up. The failure
          │    │                     policy answers this request; the breaker is not told.
          │    └── StorageMisconfigured   the store refuses us: NOPERM (ACL), WRONGPASS or NOAUTH
          │                               (credentials), a database index out of range, an
          │                               unknown command (scripting disabled). An outage until
          │                               the configuration is fixed; logged at ERROR with the fix.
          └── StorageResponseError   the store answered, but with an error: a bug in a script or
                                     bad data. Never counted as an outage, never swallowed.

A denied request is not an exception of this tree: it is
:class:`flask_distlimit.problem.RateLimitExceeded`, a werkzeug ``TooManyRequests`` subclass, so
ordinary Flask error handling (``@app.errorhandler(429)``) applies to it.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "DistLimitError",
    "StorageBusy",
    "StorageError",
    "StorageMisconfigured",
    "StorageReplyLost",
    "StorageResponseError",
    "StorageUnavailable",
]


class DistLimitError(Exception):
    """Base class of every error Flask-DistLimit raises."""


class ConfigurationError(DistLimitError, ValueError):
    """A limit string, storage URL or ``DISTLIMIT_*`` setting is invalid.

    The message names the offending value and the accepted forms.
    """


class StorageError(DistLimitError):
    """The rate-limit storage failed."""


class StorageBusy(StorageError):
    """A call waited in this process's queue for a connection to Redis (every pooled one busy)
    past its queue budget, and nothing was sent: this process is overloaded, Redis is not
    known to be unwell (:mod:`.storage.pool`).

    Never counted by the circuit breaker, never answered by the failure policy (which would
    admit everything under ``open``): the request is refused with a 503 and ``Retry-After: 1``,
    as load shedding refuses it, and charged to no limit.
    """


class StorageUnavailable(StorageError):
    """The storage could not be reached in time (an outage, counted by the breaker)."""


class StorageReplyLost(StorageUnavailable):
    """The server closed the connection after the request was sent, every time (the call and
    its repeats, which answer the first call's reply if it ran: :mod:`.storage.redis`), and a
    fresh connection answered at once: the store is up, only the reply is lost.

    The request may or may not have been counted: the failure policy answers it (``local``
    without engaging the fallback). It is not an outage, so the circuit breaker is not told: a
    ``CLIENT KILL`` that cuts every connection in flight at once, an idle timeout or a proxy
    reset must not switch the limiter to its failure policy for a whole reset timeout.
    """


class StorageMisconfigured(StorageUnavailable):
    """The storage refuses the limiter: bad credentials, missing ACL permissions, a database
    index out of range, or a command the server does not offer (scripting disabled).

    Handled as an outage (the breaker counts it, the failure policy answers the request), and
    logged at ERROR at most once a minute per process; the message names the server's answer
    and the fix.
    """


class StorageResponseError(StorageError):
    """The storage answered with an error: a script bug or bad data (not an outage)."""
