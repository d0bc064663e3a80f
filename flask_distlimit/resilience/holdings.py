"""What the processes of an app hold in their leases, as published for ``flask distlimit inspect``.

At most once a second, after a storage call that changed its leases, a process publishes
:func:`record_of` (its :data:`RECORD_LEASES` largest leases) in a call of its own, kept as long as
its longest-lived units; a request its lease covers never makes that call. :func:`holdings` reads
them back, skipping whatever is not a record. Design: docs/design-notes.md, "Lease records".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

if TYPE_CHECKING:
    from flask_distlimit.resilience.lease import Lease
    from flask_distlimit.storage.lease_records import Record

#: The most leases one process's published record lists (the most units held first).
RECORD_LEASES: Final = 64
_US: Final = 1_000_000


class LeaseRecord(NamedTuple):
    """What a process publishes of the leases it holds (:func:`record_of`)."""

    text: str  #: JSON: ``{"leases": {key: [units, seconds good]}, "more": leases left out}``
    hold: float  #: seconds it holds: as long as its longest-lived units (at least 1)


def record_of(leases: Iterable[Lease], now: int) -> LeaseRecord:
    """What a process holds in ``leases``, as published (:class:`LeaseRecord`)."""
    held: list[tuple[int, str, int]] = []
    for lease in leases:
        units, valid = lease.holds(now)
        if units:
            held.append((units, lease.key, valid))
    held.sort(reverse=True)
    shown = held[:RECORD_LEASES]
    text = {
        "leases": {key: [units, round(valid / _US, 3)] for units, key, valid in shown},
        "more": len(held) - len(shown),
    }
    hold = max((valid for _, _, valid in shown), default=0) / _US
    return LeaseRecord(json.dumps(text, separators=(",", ":")), max(1.0, hold))


class Holding(NamedTuple):
    """The units of one leased key one process held when it last published (its ``_asdict()``
    is what ``flask distlimit inspect --json`` lists)."""

    process: str  #: ``host:pid:token``
    units: int
    valid_for: float  #: seconds the units stay good, counted from now
    published_ago: float  #: seconds since the process published them


def holdings(records: Sequence[Record]) -> dict[str, list[Holding]]:
    """By storage key, what each process published that it holds and is still good; a record
    or an entry that is not what :func:`record_of` writes is skipped (garbage under the
    prefix is never an error)."""
    found: dict[str, list[Holding]] = {}
    for r in records:
        try:
            record = json.loads(r.text)
        except ValueError:
            continue
        leases = record.get("leases") if isinstance(record, dict) else None
        if not isinstance(leases, dict):
            continue
        for key, entry in leases.items():
            # [units, seconds good], as record_of writes it (JSON's true and false are no numbers)
            match entry:
                case [units, valid] if type(units) is int and type(valid) in (int, float):
                    left = round(valid - r.age, 3)
                    if units > 0 and left > 0:
                        found.setdefault(key, []).append(Holding(r.process, units, left, r.age))
    for held in found.values():
        held.sort(key=lambda h: (-h.units, h.process))
    return found
