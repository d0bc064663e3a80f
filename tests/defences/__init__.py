"""Tests of flask_distlimit.defences: shadow, concurrency, shedding, deny cache, the ledger."""
