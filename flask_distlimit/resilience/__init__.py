"""Calm when the storage is sick: circuit breakers (``breaker``, one per node: ``breakers``), the
guard every storage call goes through (``guard``, on ``guard_core``; a Cluster's groups:
``routing``; calls beside a request's: ``side_calls``; its log and health: ``storage_log``,
``guard_health``), the local fallback (``fallback``, ``node_fallbacks``, ``last_known``) and its
divisor (``instances``), and quota leasing (``lease``, ``leases``, ``holdings``).
"""
