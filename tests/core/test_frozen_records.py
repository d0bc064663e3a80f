"""The request path's frozen records get their ``__init__`` from ``slot_init``
(flask_distlimit.frozen): each takes exactly its class's fields, with their defaults, sets every
one, and the record stays frozen, comparable, hashable, copyable and picklable as a generated one
would be."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from typing import Any

import pytest

from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.resilience.outcome import Outcome

_DECISION = Decision(True, 10, 9, 1.5, 0.0)
RECORDS: list[tuple[type, dict[str, Any]]] = [
    (
        Check,
        dict(
            key="k", algorithm="fixed_window", limit=5, period=60, cost=2, shadow=True,
            token=7, release=True, meta=True, debt=True, bound="g:5/minute",
        ),
    ),
    (
        Decision,
        dict(
            allowed=False, limit=10, remaining=0, reset_after=2.5, retry_after=1.25,
            shadow_denied=True,
        ),
    ),
    (Evaluation, dict(decisions=(_DECISION,), repaired_keys=("k",), now_us=12)),
    (Outcome, dict(evaluation=Evaluation((_DECISION,)), degraded=True, unavailable=True,
              busy=True)),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "values"), RECORDS, ids=lambda v: getattr(v, "__name__", ""))
def test_init_takes_the_fields_with_their_defaults(cls: type, values: dict[str, Any]) -> None:
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        keyword_only = inspect.Parameter.KEYWORD_ONLY if f.kw_only else None
        assert p.kind is (keyword_only or inspect.Parameter.POSITIONAL_OR_KEYWORD)
        assert p.default == (
            inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        )
    assert set(values) == {f.name for f in fields}


@pytest.mark.parametrize(("cls", "values"), RECORDS, ids=lambda v: getattr(v, "__name__", ""))
def test_record_is_set_frozen_and_whole(cls: type, values: dict[str, Any]) -> None:
    record = cls(**values)
    assert {f.name: getattr(record, f.name) for f in dataclasses.fields(cls)} == values
    fields = dataclasses.fields(cls)
    positional = [values[f.name] for f in fields if not f.kw_only]
    keywords = {f.name: values[f.name] for f in fields if f.kw_only}
    assert record == cls(*positional, **keywords)  # positionally too, but keyword-only fields
    assert hash(record) == hash(cls(**values))
    assert copy.copy(record) == record and pickle.loads(pickle.dumps(record)) == record
    first = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, first, values[first])
    changed = dataclasses.replace(record, **{first: values[first]})
    assert changed == record and changed is not record


def test_defaults_apply() -> None:
    assert Check("k", "gcra", 1, 2) == Check("k", "gcra", 1, 2, 1, False, 0, False)
    assert Decision(True, 1, 0, 1.0, 0.0).shadow_denied is False
    assert Evaluation((_DECISION,)).repaired_keys == ()
    assert Outcome(None) == Outcome(None, degraded=False, unavailable=False, busy=False)


@pytest.mark.parametrize(("cls", "values"), RECORDS, ids=lambda v: getattr(v, "__name__", ""))
def test_record_copies_pickles_and_shows_as_a_generated_one(
    cls: type, values: dict[str, Any]
) -> None:
    record = cls(**values)
    deep = copy.deepcopy(record)
    assert deep == record and hash(deep) == hash(record)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # caches, Celery: any protocol
        again = pickle.loads(pickle.dumps(record, protocol))
        assert again == record and type(again) is cls
    shown = ", ".join(f"{f.name}={values[f.name]!r}" for f in dataclasses.fields(cls) if f.repr)
    assert repr(record) == f"{cls.__qualname__}({shown})"
    for field in dataclasses.fields(cls):  # every field stays frozen, set or deleted
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field.name, values[field.name])
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(record, field.name)
    assert not hasattr(record, "__dict__")  # slots: no attribute can be added


@pytest.mark.parametrize(("cls", "values"), RECORDS, ids=lambda v: getattr(v, "__name__", ""))
def test_subclasses_keep_the_fields_set(cls: type, values: dict[str, Any]) -> None:
    plain = type("Plain", (cls,), {})  # inherits the hand-written __init__
    record = plain(**values)
    assert {f.name: getattr(record, f.name) for f in dataclasses.fields(cls)} == values
    assert record != cls(**values)  # a dataclass compares equal to its own class only
    extended = dataclasses.dataclass(frozen=True, slots=True)(
        type("Extended", (cls,), {"__annotations__": {"extra": int}, "extra": 0})
    )
    more = extended(**values, extra=5)  # the generated __init__ of a dataclass subclass
    assert (
        more.extra == 5
        and {f.name: getattr(more, f.name) for f in dataclasses.fields(cls)} == values
    )
    assert copy.deepcopy(more) == more
    with pytest.raises(dataclasses.FrozenInstanceError):
        more.extra = 6


def test_outcome_flags_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Outcome(None, True)  # type: ignore[misc]
    assert Outcome(None, degraded=True).degraded
