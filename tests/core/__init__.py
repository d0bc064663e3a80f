"""Tests of flask_distlimit.core: limit strings, bounds, records, problem details."""
