"""Keys and their hash slots: a script's second key kept in its first key's slot, and a request's
checks in slot groups, one script call each, all or nothing across them (:func:`across_slots`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from redis.crc import key_slot

from flask_distlimit.core.decision import Check, Decision, Evaluation
from flask_distlimit.errors import StorageError


def same_slot_key(key: str, name: str, what: str) -> str:
    """The key ``name`` beside ``key`` in its slot: ``<key>:<name>`` when ``key`` has a hash tag
    of its own, else ``<key>:<name>:{<key>}`` (Redis then hashes ``<key>`` for both). A ``key``
    with a brace but no hash tag is a ``ValueError`` that calls it a ``what`` key."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    if end > start + 1:  # Redis hashes what is between the first "{" and the "}" after it
        return f"{key}:{name}"
    if "{" in key or "}" in key:
        raise ValueError(f"{what} key {key!r} has a brace but no hash tag")
    return f"{key}:{name}:{{{key}}}"


def slot_of(key: str) -> int:
    """The Redis Cluster hash slot of a key (honours ``{hash tags}``)."""
    return key_slot(key.encode("utf-8"))


def by_slot(keys: Iterable[str]) -> list[list[int]]:
    """Indexes of ``keys`` grouped by hash slot, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(slot_of(key), []).append(index)
    return list(groups.values())


#: Makes one script call per part (``refund``: in the script's refund mode); one result each.
RunParts = Callable[[list[list[Check]], bool], list[Evaluation | StorageError]]


def across_slots(checks: Sequence[Check], groups: list[list[int]], run: RunParts) -> Evaluation:
    """The checks of several slot groups (indexes, :func:`by_slot`), each group one atomic call
    made by ``run``: when a group denies or fails, the groups that consumed are called again in
    refund mode and give their units back (best effort: between the two calls a concurrent
    request of the same client may see them taken; a refund that fails leaves them consumed
    until the window passes; a meta check in them counts a refusal there, one breach). Raises
    the first group's failure."""
    parts = [[checks[i] for i in group] for group in groups]
    results = run(parts, False)
    denied = any(isinstance(r, Evaluation) and not r.allowed for r in results)
    if denied or any(isinstance(r, StorageError) for r in results):
        consumed = [
            n
            for n, r in enumerate(results)
            if isinstance(r, Evaluation) and r.allowed and any(c.cost for c in parts[n])
        ]
        if consumed:
            # a shadow check that would deny was not charged: give it nothing back; a meta
            # check counts the refusal (a breach), not a failure
            given = [
                [
                    replace(c, cost=0) if d.shadow_denied or (c.meta and not denied) else c
                    for c, d in zip(parts[n], results[n].decisions, strict=True)  # type: ignore[union-attr]
                ]
                for n in consumed
            ]
            for n, refunded in zip(consumed, run(given, True), strict=True):
                if isinstance(refunded, Evaluation):
                    results[n] = refunded
    return merged(checks, groups, results)


def merged(
    checks: Sequence[Check],
    groups: list[list[int]],
    results: Sequence[Evaluation | StorageError],
) -> Evaluation:
    """The evaluation of ``checks`` from the results of their slot groups (indexes, in order);
    raises the first group's failure."""
    failure = next((r for r in results if isinstance(r, StorageError)), None)
    if failure is not None:
        raise failure
    decisions: dict[int, Decision] = {}
    repaired: list[str] = []
    for group, result in zip(groups, results, strict=True):
        assert isinstance(result, Evaluation)
        decisions.update(zip(group, result.decisions, strict=True))
        repaired.extend(result.repaired_keys)
    node_now = results[0].now_us if len(results) == 1 else 0  # type: ignore[union-attr]
    return Evaluation(tuple(decisions[i] for i in range(len(checks))), tuple(repaired), node_now)
