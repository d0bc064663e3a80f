"""Tests of flask_distlimit.engine: the Lua scripts and their Python twins agree, under races
too."""
