"""Tests of flask_distlimit.declare: what the decorators accept and record."""
