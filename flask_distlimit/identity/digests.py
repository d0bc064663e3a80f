"""Identity tags: keyed digests of identity texts, and where their key comes from.

A storage key holds its client only as a keyed BLAKE2b-80 tag, so no client can compute its
Cluster slot, and every worker and replica computes the same tags. The digest key is derived
from the app's secret, else a value the storage keeps for the deployment, re-read at most every
:data:`REFRESH_INTERVAL` seconds on a request (docs/identity.md, "Keyed digests").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

from flask_distlimit.errors import StorageError
from flask_distlimit.storage.base import Storage

log = logging.getLogger("flask_distlimit.digests")  # a public name (docs/failure-modes.md), kept

#: The time to live of the storage-kept digest key: 0, none. A key with a TTL is a candidate for
#: every ``volatile-*`` eviction policy, and its loss keys every client two ways.
SHARED_KEY_TTL: Final = 0
#: Seconds between two reads of the storage-kept key by one process: how long two processes can
#: key a client two ways after the key was lost (``FLUSHALL``, ``allkeys-*`` eviction). The
#: instance heartbeat's pace: one small script call per process every 5 s, riding on a request.
REFRESH_INTERVAL: Final = 5.0
#: Seconds before a process that could not read the storage-kept key tries again.
RETRY_INTERVAL: Final = 5.0
#: Seconds the storage remembers the secret a process started with (by a tag, never the secret):
#: processes started this close together with different secrets are told (check_secret).
SECRET_SEEN_TTL: Final = 120.0

#: Identities up to this length have their tag cached (most requests come from clients seen
#: before); longer ones (a key_func may return kilobytes) are hashed every time.
_CACHED_LENGTH: Final = 128
_CACHE_SIZE: Final = 4096
_CONTEXT: Final = b"flask-distlimit identity-tag"
#: What the guard is told a read of the storage-kept key is (it names it in its reports).
_READ: Final = "the identity tag key's read"


class SideCallGuard(Protocol):
    """What the tags ask before reading their key: the app's
    :class:`~flask_distlimit.resilience.guard.Guard` (its
    :meth:`~flask_distlimit.resilience.guard.Guard.open_side_call`)."""

    def open_side_call(
        self, key: str, what: str
    ) -> Callable[[BaseException | None], None] | None: ...


def _unheard(error: BaseException | None) -> None:
    """The report of a read no guard watches: nobody is told."""


def digest_key(key_prefix: str) -> str:
    """The storage key of the deployment's tag key under ``key_prefix`` (its node's breaker
    is the one :class:`IdentityTags` asks about on a Redis Cluster)."""
    return f"{key_prefix}:identity-digest-key"


def tag_secret(secret: bytes) -> bytes:
    """The tag key derived from an app secret (``DISTLIMIT_API_KEY_SECRET`` or ``SECRET_KEY``)."""
    return hmac.new(secret, _CONTEXT, hashlib.sha256).digest()


class _Tags(dict[str, str]):
    """The tags of one key by identity text, each made on its first lookup; identities up to
    :data:`_CACHED_LENGTH` characters are kept (emptied when full), longer ones never."""

    def __init__(self, key: bytes) -> None:
        super().__init__()
        self._base = hashlib.blake2b(digest_size=10, key=key)

    def __missing__(self, identity: str) -> str:
        digest = self._base.copy()
        digest.update(identity.encode("utf-8", "surrogatepass"))
        tag = digest.hexdigest()
        if len(identity) <= _CACHED_LENGTH:
            if len(self) >= _CACHE_SIZE:
                self.clear()
            self[identity] = tag
        return tag


class IdentityTags:
    """The identity tags of one app's keys (see the module docstring).

    - ``secret``: the tag key from :func:`tag_secret`; ``None`` reads (and sets) the deployment's
      key in ``storage`` under ``<key_prefix>:identity-digest-key``;
    - ``clock``: monotonic seconds, for the refresh and retry intervals;
    - ``guard``: asked when a read or refresh is due (never per request), before the storage
      is tried (:meth:`SideCallGuard.open_side_call` on :func:`digest_key`): the read is made
      only while the circuit breaker of the node serving that key lets calls through (else it
      is retried after :data:`RETRY_INTERVAL`), and that breaker hears how it ended (an outage
      counts toward opening it, an answer resets its count, as for a request's call). Default
      (``None``): always try, tell nobody.

    :attr:`tag` is what the request path calls.
    """

    def __init__(
        self,
        secret: bytes | None = None,
        *,
        storage: Storage | None = None,
        key_prefix: str = "ratelimit",
        clock: Callable[[], float] = time.monotonic,
        guard: SideCallGuard | None = None,
    ) -> None:
        if secret is None and storage is None:
            raise ValueError("IdentityTags needs a secret or a storage to keep its key in")
        self.storage_key = digest_key(key_prefix)
        self._secrets_key = f"{key_prefix}:identity-secrets"  # check_secret's
        self._storage = storage
        self._clock = clock
        self._guard = guard
        self._lock: threading.Lock | None = None  # made on first use (after_fork)
        self._warned = False
        #: ``"secret"`` (from the app's secret) or ``"storage"`` (kept by the storage)
        self.source = "secret" if secret is not None else "storage"
        #: the storage has answered (always true with a secret)
        self.settled = secret is not None
        self._due = float("inf") if secret is not None else float("-inf")
        # The value offered to the storage: this process's own until it has read the shared one.
        self._value = secrets.token_hex(32)
        self._tags = _Tags(secret or tag_secret(self._value.encode()))
        #: ``tag(identity text) -> 20 hex characters`` (with a secret, a lookup of its tags)
        self.tag: Callable[[str], str] = self._tags.__getitem__ if self.settled else self._kept_tag
        if secret is None and storage is not None and storage.scheme != "memory":
            log.warning(
                "Neither DISTLIMIT_API_KEY_SECRET nor SECRET_KEY is set, so the identity digests "
                "are keyed with a random value kept in Redis at %r (no TTL). Redis must never "
                "evict it (maxmemory-policy noeviction, or volatile-*; never allkeys-*): if it "
                "is lost, processes key each client two ways for up to %.0f s. Set SECRET_KEY "
                "(or DISTLIMIT_API_KEY_SECRET), the same in every process, to derive the key "
                'from it instead (docs/identity.md, "Keyed digests").',
                self.storage_key,
                REFRESH_INTERVAL,
            )

    # -- the request path --------------------------------------------------------------------

    def _kept_tag(self, identity: str) -> str:
        if self._clock() >= self._due:
            self._maintain(wait=not self.settled)
        return self._tags[identity]

    # -- the storage-kept key ----------------------------------------------------------------

    def require(self) -> None:
        """Read the storage-kept key now unless it was read: for tools (``flask distlimit``,
        ``reset_identity``), which must name the keys requests use. Raises the storage's
        :class:`~flask_distlimit.errors.StorageError` when it cannot be read."""
        if self.source == "storage" and not self.settled:
            self._read()

    def _maintain(self, *, wait: bool) -> None:
        """Read (or refresh) the storage-kept key when due; one thread at a time. Before the
        first read, the others wait for it (their requests would be counted apart otherwise)."""
        if self._lock is None:
            self._lock = threading.Lock()
        if not self._lock.acquire(blocking=wait):
            return
        try:
            if self._clock() < self._due:
                return  # another thread did it
            guard = self._guard
            heard = _unheard if guard is None else guard.open_side_call(self.storage_key, _READ)
            if heard is None:
                self._due = self._clock() + RETRY_INTERVAL
                return
            self._read(heard)
        except StorageError as exc:  # an outage; anything else (a bug) is raised
            if not self._warned:
                self._warned = True
                log.warning(
                    "Cannot read the identity digest key %r from the storage (%s); until it "
                    "can, this process tags identities with a key of its own and tries again "
                    "every %.0f s. Set DISTLIMIT_API_KEY_SECRET or SECRET_KEY to derive the key "
                    "from a secret instead. (Logged once.)",
                    self.storage_key, exc, RETRY_INTERVAL,
                )  # fmt: skip
        finally:
            self._lock.release()

    def _read(self, heard: Callable[[BaseException | None], None] = _unheard) -> None:
        """Read the storage-kept key (adopting it) and tell ``heard`` how the read ended; on any
        error, try again after :data:`RETRY_INTERVAL`, and raise it."""
        assert self._storage is not None
        try:
            value = self._storage.shared_value(self.storage_key, self._value, SHARED_KEY_TTL)
        except BaseException as exc:
            heard(exc)
            self._due = self._clock() + RETRY_INTERVAL
            raise
        heard(None)
        if value != self._value or not self.settled:
            if self.settled:
                log.warning(
                    "The identity digest key %r changed in the storage (flushed, or set by "
                    "another deployment with the same key prefix?); this process adopts it, and "
                    "counts its clients in fresh buckets.",
                    self.storage_key,
                )
            self._value = value
            self._tags = _Tags(tag_secret(value.encode()))  # no tag of the old key is kept
        self.settled = True
        self._due = self._clock() + REFRESH_INTERVAL

    def check_secret(self) -> None:
        """Log an ERROR when a process of the deployment started within
        :data:`SECRET_SEEN_TTL` of this one keys identities with another secret (a random
        ``SECRET_KEY`` per process): each counts every client apart. Once per process, at
        ``init_app``; an outage is the start-up check's to tell."""
        storage = self._storage
        if self.source != "secret" or storage is None:
            return
        key = self._secrets_key
        try:
            seen = storage.heartbeat(key, self._tags[_CONTEXT.decode()], SECRET_SEEN_TTL)
        except StorageError:
            return
        if seen > 1:
            log.error(
                "%d secrets key identities in this deployment (processes started within %.0f s, "
                "at %r): each counts every client apart, each limit admits once per secret. Set "
                "the same SECRET_KEY (or DISTLIMIT_API_KEY_SECRET) in every process, never a "
                "random one per process (apps meant to count apart: each its own "
                "DISTLIMIT_KEY_PREFIX); expected only while a changed secret rolls out.",
                seen, SECRET_SEEN_TTL, key,
            )  # fmt: skip

    def after_fork(self) -> None:
        """In a forked child: a fresh lock, made on first use (a parent's thread may have held
        the old one), so after gevent's patch in a worker of ``gunicorn --preload -k gevent``:
        one made before it blocks the whole worker while the first read holds it."""
        self._lock = None
