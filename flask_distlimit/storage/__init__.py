"""Rate-limit stores: ``memory://`` in-process, Redis single node, Sentinel and Cluster."""

from __future__ import annotations

from .base import Storage

__all__ = ["Storage"]
