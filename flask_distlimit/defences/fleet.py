"""Fleet-usage load shedding: capacity in flight across every instance, with a reserve for the
most important traffic.

A request of priority p is admitted while fewer than ``floor(DISTLIMIT_FLEET_CAPACITY *
DISTLIMIT_FLEET_SHARES[p])`` are in flight fleet-wide, else a 503: one concurrency slot on ONE
key for the fleet, in the request's one storage call (docs/defences.md, "Fleet usage").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from flask_distlimit.core.algorithms import CONCURRENCY
from flask_distlimit.core.decision import Check
from flask_distlimit.core.limits import Rate
from flask_distlimit.core.priorities import PRIORITIES, Priority
from flask_distlimit.declare.keys import key_parts
from flask_distlimit.declare.policy_items import policy_item, sf_string
from flask_distlimit.declare.route_limits import BoundLimit
from flask_distlimit.defences.concurrency import slot_check
from flask_distlimit.errors import StorageError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flask_distlimit.storage.base import Storage


#: The hash tag of the fleet's key: never an identity tag (those are hex digests).
FLEET_TAG: Final = "fleet"


class Fleet:
    """The fleet's capacity and each priority's part of it (see the module docstring)."""

    def __init__(
        self, prefix: str, capacity: int, shares: Mapping[Priority, float], lease: int
    ) -> None:
        self.capacity = capacity
        self.lease = lease
        head, tail = key_parts(prefix, "fleet", CONCURRENCY)
        self.key = head + FLEET_TAG + tail
        #: one bound "limit" per priority: the same key, each its own number of slots
        self._bounds: dict[Priority, BoundLimit] = {}
        for p in PRIORITIES:
            slots = max(1, math.floor(capacity * shares[p]))
            name = f"fleet:{p}"
            self._bounds[p] = BoundLimit(
                name=name,
                limit_id="fleet",
                rate=Rate(slots, 1),
                algorithm=CONCURRENCY,
                keyed_on="ip",
                key_head=head,
                key_tail=tail,
                policy=policy_item(name, slots, 1),
                quoted=sf_string(name),
            )

    def check(self, priority: Priority) -> Check:
        """A check taking one of ``priority``'s slots of the fleet, under a fresh token."""
        return slot_check(self._bounds[priority], FLEET_TAG, self.lease)

    def health(self, storage: Storage, now_us: int | None = None) -> dict[str, object]:
        """Requests in flight across the fleet now (a peek; expired slots are removed), for the
        health report: the capacity and the ``error`` when the storage cannot say."""
        peek = Check(self.key, CONCURRENCY, self.capacity, self.lease, 0)
        try:
            decision = storage.evaluate([peek], now_us=now_us).decisions[0]
        except StorageError as exc:
            return {"capacity": self.capacity, "error": str(exc)[:200]}
        in_flight = self.capacity - decision.remaining
        return {
            "capacity": self.capacity,
            "in_flight": in_flight,
            "utilization": round(in_flight / self.capacity, 4),
            "slots": {p: bound.rate.amount for p, bound in self._bounds.items()},
        }
