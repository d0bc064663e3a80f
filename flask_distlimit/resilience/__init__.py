"""Calm when the storage is sick: circuit breakers (one per node), the guard every storage call
goes through, the local fallback and its divisor, and quota leasing.
"""
