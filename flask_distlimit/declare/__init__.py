"""Declaring limits: the decorators, the records they make and the registry they fill, keyed
by the objects a view is known by; per-request values, refusal options, request filters, storage
keys, and what the declared limits become for one route (``route_limits``: its plan).
"""
