"""Rate-limit stores: ``memory://`` in-process, Redis single node, Sentinel and Cluster."""

from __future__ import annotations

from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.urls import from_url

__all__ = ["Storage", "from_url"]
