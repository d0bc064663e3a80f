"""Declaring limits: the decorators and the registry they fill, per-request values, refusal options,
request filters, storage keys, and what the declared limits become for one route (its plan).
"""
