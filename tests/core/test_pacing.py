"""Log pacing (flask_distlimit.core.pacing): one line per interval, one per key per window."""

from __future__ import annotations

from flask_distlimit.core.decision import Check
from flask_distlimit.core.pacing import OncePerWindow, Pace


def test_a_pace_lets_one_line_through_per_interval_and_counts_the_rest() -> None:
    pace = Pace(60)
    assert pace.due(0) == 0
    assert pace.due(10) is None and pace.due(59) is None
    assert pace.due(60) == 2  # the two held back are counted on the next line


def _check(key: str, period: int) -> Check:
    return Check(key, "fixed_window", 10, period)


def test_a_key_is_told_of_once_per_its_window() -> None:
    seen = OncePerWindow()
    k = _check("k", 2)  # a 2 s window, in microseconds
    assert seen.due([k], 0) == [k]
    assert seen.due([k], 1_999_999) == []
    other = _check("other", 2)
    assert seen.due([k, other], 2_000_000) == [k, other]


def test_only_the_keys_told_of_are_noted() -> None:
    """A key refused again inside its window is not noted anew: it is told of again when the
    window it was told of in ends, not a window after its last refusal."""
    seen = OncePerWindow()
    k, j = _check("k", 2), _check("j", 2)
    assert seen.due([k], 0) == [k]
    assert seen.due([k, j], 1_000_000) == [j]
    assert seen.due([k, j], 2_000_000) == [k]


def test_a_full_set_drops_ended_windows_first_then_everything() -> None:
    seen = OncePerWindow(kept=3)
    seen.due([_check("a", 1), _check("b", 10), _check("c", 10)], 0)
    seen.due([_check("d", 10)], 1_000_000)  # full: "a" has ended, only it goes
    assert set(seen.until) == {"b", "c", "d"}
    seen.due([_check("e", 10)], 2_000_000)  # full, none ended: all go, "e" is kept
    assert set(seen.until) == {"e"}
