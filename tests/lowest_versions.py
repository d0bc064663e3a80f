"""The lowest version of each dependency that ``pyproject.toml`` declares, in a cached venv.

``.ci/run`` runs the suite's core a second time with that venv's python
(``python tests/lowest_versions.py`` builds it if needed and prints its python), and
``tests/identity/test_proxy_headers.py`` runs its oldest-werkzeug checks there. The package itself
is not installed in the venv: it comes from this checkout through ``PYTHONPATH``.

The venv lives in ``<tmp>/flask-distlimit-lowest-<digest>`` (it outlives a checkout: CI clones
afresh), the digest naming its pins and test tools, so a change of a floor builds a new one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib  # Python 3.11+, as the test suite

ROOT = Path(__file__).resolve().parent.parent
#: The dependencies whose floors are tested (``pyproject.toml`` declares each with ``>=``).
DEPENDENCIES = ("flask", "werkzeug", "redis", "pybreaker")
#: What the core's tests import besides the package (their newest releases that install).
TEST_TOOLS = (
    "pytest",
    "fakeredis[lua]",
    "hypothesis",
    "gunicorn",
    "asgiref",
    "pyjwt",
    "prometheus-client",
)
_FLOOR = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)")


def lowest_pins(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """``name==floor`` for each of :data:`DEPENDENCIES`, from ``project.dependencies``."""
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    floors: dict[str, str] = {}
    for requirement in declared:
        found = _FLOOR.match(requirement)
        if found:
            floors[found.group(1).lower()] = found.group(2)
    missing = [name for name in DEPENDENCIES if name not in floors]
    if missing:
        raise RuntimeError(f"pyproject.toml declares no '>=' floor for {', '.join(missing)}")
    return [f"{name}=={floors[name]}" for name in DEPENDENCIES]


def venv_python(pins: list[str] | None = None) -> Path:
    """The python of a venv holding ``pins`` (default: :func:`lowest_pins`) and the test tools;
    built on first use (from the package index), reused after."""
    pins = lowest_pins() if pins is None else pins
    digest = hashlib.sha256(" ".join([*pins, *TEST_TOOLS]).encode()).hexdigest()[:12]
    home = Path(tempfile.gettempdir()) / f"flask-distlimit-lowest-{digest}"
    python = home / "bin" / "python"
    if python.exists():
        return python
    # Built aside and renamed into place whole: a build that broke off is never used, and of
    # two processes building at once one wins (a venv run as `python -m` may be moved).
    scratch = home.with_name(f"{home.name}.building-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    steps = [
        [sys.executable, "-m", "venv", str(scratch)],
        [
            str(scratch / "bin" / "python"), "-m", "pip", "install", "--quiet",
            "--disable-pip-version-check", *pins, *TEST_TOOLS,
        ],
    ]  # fmt: skip
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            raise RuntimeError(
                f"Could not build the venv with {' '.join(pins)} ({' '.join(step[:4])} exited "
                f"{result.returncode}): {result.stderr[-2000:]}\nIt needs `python -m venv` "
                "(apt-get install python3-venv) and the package index reachable by pip."
            )
    try:
        scratch.rename(home)
    except OSError:  # another process put its build there first
        shutil.rmtree(scratch, ignore_errors=True)
    return python


if __name__ == "__main__":
    print(venv_python())
