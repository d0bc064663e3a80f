"""The storage as the extension sees it: every call guarded against outages.

:class:`Guard` is the one seam between the request path and the storage. It decides what an
outage means for a request (``DISTLIMIT_FAILURE_POLICY``):

- ``"open"``: allow, marked degraded;
- ``"closed"``: refuse with 503 (the extension turns ``unavailable`` into a problem+json 503);
- ``"local"``: decide in-process (:mod:`flask_distlimit.fallback`), marked degraded.

(First version: no circuit breaker yet; the failure-handling work adds pybreaker, the divided
local fallback, instance heartbeats and health here, behind the same interface.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .decision import Check, Evaluation
from .errors import StorageUnavailable
from .storage.base import Storage

__all__ = ["FailurePolicy", "Guard", "Outcome"]

FailurePolicy = Literal["open", "closed", "local"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the guarded storage call decided.

    - ``evaluation``: the decisions (from the storage, or from the local fallback when degraded);
      ``None`` when the storage failed under policy ``open`` or ``closed``.
    - ``degraded``: the storage failed; the answer comes from the failure policy.
    - ``unavailable``: policy ``closed`` and the storage failed: answer 503.
    """

    evaluation: Evaluation | None
    degraded: bool = False
    unavailable: bool = False


class Guard:
    """Calls the storage and applies the failure policy on outages."""

    def __init__(
        self,
        storage: Storage,
        *,
        policy: FailurePolicy = "open",
        fail_max: int = 5,
        reset_timeout: float = 30.0,
        instances: int | Literal["auto"] = 1,
        key_prefix: str = "ratelimit",
    ) -> None:
        self.storage = storage
        self.policy: FailurePolicy = policy
        self.fail_max = fail_max
        self.reset_timeout = reset_timeout
        self.instances = instances
        self.key_prefix = key_prefix

    def health(self) -> dict[str, object]:
        """Storage ping latency, breaker state, scripts loaded, instances seen."""
        try:
            latency: float | None = self.storage.ping()
            loaded = self.storage.scripts_loaded()
        except StorageUnavailable:
            latency, loaded = None, False
        return {
            "storage": self.storage.scheme,
            "latency_ms": None if latency is None else round(latency * 1000, 3),
            "scripts_loaded": loaded,
            "breaker": "closed",
            "instances": self.instances,
        }

    def evaluate(
        self,
        checks: Sequence[Check],
        *,
        policy: FailurePolicy | None = None,
        now_us: int | None = None,
    ) -> Outcome:
        """Evaluate ``checks``; ``policy`` overrides the default for one route."""
        try:
            return Outcome(self.storage.evaluate(checks, now_us=now_us))
        except StorageUnavailable:
            chosen = policy or self.policy
            if chosen == "closed":
                return Outcome(None, degraded=True, unavailable=True)
            return Outcome(None, degraded=True)
