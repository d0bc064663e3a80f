"""The house rules' own checks: ruff and mypy strict run in CI's quality step (.ci/quality/run)
on pinned tool versions and pinned dependency sets, never on whatever pip gives today; these
tests hold the pins to what pyproject.toml declares, so the sets cannot drift from the floors."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import tomllib

from tests.lowest_versions import lowest_pins

ROOT = Path(__file__).resolve().parents[2]
QUALITY = ROOT / ".ci" / "quality"
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)$")


def _pins(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (QUALITY / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        found = _PIN.match(line)
        assert found, f".ci/quality/{name}: {line!r} is not pinned with =="
        pins[found.group(1).lower().replace("_", "-")] = found.group(2)
    return pins


def _floor(requirement: str) -> tuple[str, str]:
    name, floor = re.split(r"\s*>=\s*", requirement)
    return name.lower(), floor


def _release(version: str) -> tuple[int, ...]:
    parts = [int(part) for part in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_every_quality_requirement_is_pinned() -> None:
    for name in ("tools.txt", "lowest.txt", "newest.txt"):
        assert _pins(name), name
    assert set(_pins("tools.txt")) == {"mypy", "ruff"}


def test_the_lowest_set_is_the_declared_floors() -> None:
    lowest = _pins("lowest.txt")
    for pin in lowest_pins():
        name, version = pin.split("==")
        assert lowest[name] == version, f"{name}: pyproject.toml's floor is {version}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra in ("prometheus", "otel"):
        name, floor = _floor(extras[extra][0])
        assert _release(lowest[name]) == _release(floor), f"{name}: the [{extra}] extra's floor"


def test_the_newest_set_holds_every_runtime_dependency_above_its_floor() -> None:
    newest = _pins("newest.txt")
    for pin in lowest_pins():
        name, floor = pin.split("==")
        assert name in newest
        assert _release(newest[name]) >= _release(floor)


def test_ci_runs_the_quality_step() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/quality/run" in ci
    script = (QUALITY / "run").read_text()
    for check in ("ruff check", "ruff format --check", "mypy"):
        assert check in script


def test_package_ships_type_marker_and_lua() -> None:
    package = ROOT / "flask_distlimit"
    assert (package / "py.typed").exists()
    assert shutil.which("redis-server"), "redis-server must be installed for the suite"
    shipped = {p.stem for p in (package / "engine" / "lua").glob("*.lua")}
    assert shipped >= {
        "evaluate", "fixed_window", "gcra", "sliding_window_counter", "sliding_window_log",
        "token_bucket",
    }  # fmt: skip
