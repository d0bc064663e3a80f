"""Frozen records built at nearly the cost of plain ones.

:func:`slot_init` gives a frozen slotted dataclass an ``__init__`` that sets each field through
its slot's own descriptor instead of ``object.__setattr__``: the record stays exactly as frozen,
comparable and hashable (docs/design-notes.md, "Frozen records").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def slot_init(cls: type[T]) -> type[T]:
    """``cls`` (a ``@dataclass(frozen=True, slots=True)``) with such an ``__init__``, taking its
    fields as the generated one does (positional, then keyword-only, with their defaults); it is
    written from the fields, as :mod:`dataclasses` writes its own."""
    fields = sorted(dataclasses.fields(cls), key=lambda f: f.kw_only is True)
    scope = {f"_set_{f.name}": vars(cls)[f.name].__set__ for f in fields}
    params = ["self"]
    for f in fields:
        if f.kw_only and "*" not in params:
            params.append("*")
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            scope[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
    body = "".join(f"\n    _set_{f.name}(self, {f.name})" for f in fields)
    exec(f"def __init__({', '.join(params)}):{body}", scope)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
