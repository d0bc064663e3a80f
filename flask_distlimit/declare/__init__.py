"""Declaring limits: the decorators (``decorators``), the records they make (``specs``) after
checking the options (``options``), the registry they fill (``registry``) by the objects a view
is known by (``targets``), per-request values, refusal options, request filters, storage keys,
and what the declared limits become for one route (``route_limits``: its plan).
"""
