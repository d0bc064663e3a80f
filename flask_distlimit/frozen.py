"""Frozen records built at nearly the cost of plain ones.

:func:`slot_setters` answers setters for a frozen slotted dataclass's fields, which an
``__init__`` of the class's own uses instead of ``object.__setattr__``: the record stays exactly
as frozen, comparable and hashable (docs/design-notes.md, "Frozen records").
tests/core/test_frozen_records.py checks that each such ``__init__`` sets every field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def slot_setters(cls: type, *names: str) -> tuple[Callable[[Any, Any], None], ...]:
    """The setters of the slots ``names`` of ``cls`` (a class with ``__slots__``), in order."""
    return tuple(vars(cls)[name].__set__ for name in names)
