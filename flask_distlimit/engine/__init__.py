"""The algorithms' code, each written once per language: its Lua (``lua/<name>.lua``, run
atomically in Redis) and its pure-Python twin (``<name>.py``, which decides exactly as the Lua
does, for ``memory://`` and the local fallback), with what the twins share in ``common``.

``registry`` holds one entry per algorithm (its code, its twin, its bounds, what leasing and
give-backs need of it): the layers above ask it instead of naming algorithms. ``lua_source``
builds the script's text at import (the fast path generated from each algorithm's marked
blocks); ``scripts`` is the script's wire contract (arguments, replies).
"""
