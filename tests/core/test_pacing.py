"""Log pacing (flask_distlimit.core.pacing): one line per interval, one per key per window."""

from __future__ import annotations

from flask_distlimit.core.pacing import OncePerWindow, Pace


def test_a_pace_lets_one_line_through_per_interval_and_counts_the_rest() -> None:
    pace = Pace(60)
    assert pace.due(0) == 0
    assert pace.due(10) is None and pace.due(59) is None
    assert pace.due(60) == 2  # the two held back are counted on the next line


def test_a_key_is_told_of_once_per_its_window() -> None:
    seen = OncePerWindow()
    assert seen.due("k", 0)
    seen.mark([("k", 2.0)], 0)  # a 2 s window, in microseconds
    assert not seen.due("k", 1_999_999)
    assert seen.due("k", 2_000_000) and seen.due("other", 1)


def test_a_full_set_drops_ended_windows_first_then_everything() -> None:
    seen = OncePerWindow(kept=3)
    seen.mark([("a", 1.0), ("b", 10.0), ("c", 10.0)], 0)
    seen.mark([("d", 10.0)], 1_000_000)  # full: "a" has ended, only it goes
    assert set(seen.until) == {"b", "c", "d"}
    seen.mark([("e", 10.0)], 2_000_000)  # full, none ended: all go, "e" is kept
    assert set(seen.until) == {"e"}
