"""What ``inspect`` reads of the published lease records: whatever is not what ``record_of``
writes is skipped, never an error."""

from __future__ import annotations

import json

from flask_distlimit.resilience.holdings import Holding, holdings
from flask_distlimit.storage.lease_records import Record


def test_holdings_skips_every_record_and_entry_record_of_never_writes() -> None:
    entries = {
        "ok": [3, 10],
        "float": [2, 0.5],
        "bool units": [True, 10],
        "bool seconds": [3, False],
        "no units": [0, 10],
        "negative": [-1, 10],
        "float units": [1.5, 10],
        "text": ["3", 10],
        "short": [3],
        "long": [3, 10, 1],
        "object": {"units": 3},
        "expired": [3, 0.1],
    }
    records = [
        Record("a", 0.2, json.dumps({"leases": entries, "more": 0})),
        Record("b", 0.0, "not json"),
        Record("c", 0.0, json.dumps([1, 2])),
        Record("d", 0.0, json.dumps({"leases": [["k", 1, 2]]})),
        Record("e", 0.0, json.dumps({"leases": {"ok": [5, 1]}})),
    ]
    assert holdings(records) == {
        "ok": [Holding("e", 5, 1.0, 0.0), Holding("a", 3, 9.8, 0.2)],
        "float": [Holding("a", 2, 0.3, 0.2)],
    }
