"""The algorithms' code: each algorithm's Lua (``lua/``, run atomically in Redis) and its
pure-Python twin, which decides exactly as the Lua does; ``scripts`` assembles the script a storage
loads and reads its replies.
"""
