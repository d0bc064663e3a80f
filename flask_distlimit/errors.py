"""The exceptions Flask-DistLimit raises. One small hierarchy; catch the branch you can act on::

    DistLimitError
     ├── ConfigurationError        (also a ValueError) a bad limit string, URL or DISTLIMIT_*
     │                             value; raised when the app is configured, never per request
     └── StorageError              the rate-limit store failed
          ├── StorageBusy              this process's own load (a call queued past its budget):
          │                            no outage, no failure policy; a 503 with Retry-After: 1
          ├── StorageUnavailable       an outage: the breaker counts it, the failure policy answers
          │    ├── StorageReplyLost      the reply was lost but the store is up: breaker not told
          │    ├── StorageFull           OOM or MISCONF: decided at the local share, never unlimited
          │    └── StorageMisconfigured  NOPERM, WRONGPASS, NOAUTH, a bad database, no scripting
          └── StorageResponseError     an error reply (a script bug, bad data): never an outage

:class:`ClearedAddressWarning` warns of ``limiter.clear(name)`` on an address's counter. A
denial is no exception of this tree: it is a werkzeug ``TooManyRequests``
(:mod:`flask_distlimit.core.problem`), so ``@app.errorhandler(429)`` applies to it.
"""

from __future__ import annotations

__all__ = [
    "ClearedAddressWarning",
    "ConfigurationError",
    "DistLimitError",
    "StorageBusy",
    "StorageError",
    "StorageFull",
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


class StorageFull(StorageUnavailable):
    """The storage is up and answers, but refuses to write: out of memory (``OOM command not
    allowed when used memory > 'maxmemory'``, under ``maxmemory-policy noeviction``) or unable
    to persist (``MISCONF``).

    Another client's keys may have filled it, so this is neither an outage of the node (the
    circuit breaker hears an answer and stays closed for every other request) nor a reason to
    admit anyone: whatever the failure policy, the request is decided by the local fallback at
    this process's share of each limit (``"closed"`` answers 503, as it does for an outage);
    under policy ``"open"`` the local shares keep counting until the keys they decided are
    handed back. A subclass of :class:`StorageUnavailable`, so code that knows only outages
    still never admits on it without a policy. Logged at WARNING at most once a minute.
    """


class StorageMisconfigured(StorageUnavailable):
    """The storage refuses the limiter: bad credentials, missing ACL permissions, a database
    index out of range, or a command the server does not offer (scripting disabled).

    Handled as an outage (the breaker counts it, the failure policy answers the request), and
    logged at ERROR at most once a minute per process; the message names the server's answer
    and the fix.
    """


class ClearedAddressWarning(UserWarning):
    """``limiter.clear(name)`` deleted a counter keyed on the client's address (the request's
    own identity of an anonymous client, or a ``key_func`` answering the address).

    Whoever succeeds from that address resets the count for everyone behind it: a login limit
    counted per address and cleared on success lets anyone with an account of their own try 5
    wrong passwords, log in, and try 5 more, without end. Clear only what is keyed on the
    authenticated account (``key_func`` = the account name), and keep an address limit that is
    never cleared (docs/limits.md, "Counting only some responses").
    """


class StorageResponseError(StorageError):
    """The storage answered with an error: a script bug or bad data (not an outage)."""
