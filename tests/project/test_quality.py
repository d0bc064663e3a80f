"""The house rules, checked by the suite itself: ruff and mypy strict stay clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_ruff_is_clean() -> None:
    result = _run("ruff", "check", "flask_distlimit", "tests", "bench", "example_app")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_strict_is_clean() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_package_ships_type_marker_and_lua() -> None:
    package = ROOT / "flask_distlimit"
    assert (package / "py.typed").exists()
    assert shutil.which("redis-server"), "redis-server must be installed for the suite"
    shipped = {p.stem for p in (package / "engine" / "lua").glob("*.lua")}
    assert shipped >= {
        "evaluate", "fixed_window", "gcra", "sliding_window_counter", "sliding_window_log",
        "token_bucket",
    }  # fmt: skip
