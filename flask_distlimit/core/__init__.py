"""The vocabulary every layer shares: limit strings, algorithm names, checks and decisions,
failure policies, request priorities, and refusals as problem details.

Imports nothing of the package but its foundation modules (``errors``, ``_typing``, ``frozen``).
"""
