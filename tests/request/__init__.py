"""Tests of flask_distlimit.request: the request path's headers, charges and current limits."""
