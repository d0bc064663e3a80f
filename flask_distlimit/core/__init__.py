"""The vocabulary every layer shares: limit strings, algorithm names and bounds, what a storage
call takes and answers (checks, decisions), request priorities, and refusals as problem details.

Imports nothing of the package but its foundation modules (``errors``, ``_typing``, ``frozen``).
"""
