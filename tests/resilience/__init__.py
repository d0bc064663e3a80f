"""Tests of flask_distlimit.resilience: breakers, the guard, the local fallback, leases, faults."""
