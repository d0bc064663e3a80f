"""Rate-limit stores: ``memory://`` in-process, Redis single node, Sentinel and Cluster."""

from __future__ import annotations

from .base import Storage
from .urls import from_url

__all__ = ["Storage", "from_url"]
