"""Tests of flask_distlimit.ops and the CLI: operator tools, migration, serving checks."""
