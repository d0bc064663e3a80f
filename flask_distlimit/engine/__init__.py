"""The algorithms, each written once per language: its Lua (``lua/<name>.lua``, run atomically in
Redis) and its Python twin (``<name>.py``, deciding exactly as the Lua, for ``memory://`` and the
local fallback). ``registry`` holds one entry per algorithm, which the layers above ask instead of
naming algorithms; ``lua_source`` builds the script; ``scripts`` is its wire contract.
"""
