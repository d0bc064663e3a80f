"""Every third-party module the code imports is declared in ``pyproject.toml`` where that code
needs it: the package's in its dependencies (or an extra, for optional imports), the tests' in the
``test`` extra, the example's in ``example``, the benchmarks' in ``bench``.

The README's test command runs in a fresh venv holding only what ``.[test]`` installs (and
``.ci/run`` runs it so), and a module that the machine's Python happened to have hid a missing
``cryptography`` there once. This finds such a module without building a venv: every ``import``
(function-local and ``TYPE_CHECKING`` ones included) is mapped to the distribution that provides
it, or, when nothing installed provides it, to the distribution of the same name.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: Imported through the API of a declared dependency that requires it, never on their own.
THROUGH = {
    "click": "flask",  # Flask's CLI is click's: flask.cli.AppGroup is a click.Group
    "_typeshed": None,  # mypy's stubs, imported under TYPE_CHECKING only
}
#: Which code needs which lists: (directory, extras it may use besides the dependencies, and
#: distributions it may import undeclared, each only where it is already running).
SCOPES = [
    # The package's optional imports are guarded: the extras' (jwt, prometheus, otel), and
    # gunicorn's, read only inside a process that gunicorn started.
    ("flask_distlimit", ("jwt", "prometheus", "hiredis", "otel"), {"gunicorn"}),
    ("tests", ("test",), set()),
    ("example_app", ("example",), set()),
    ("bench", ("bench", "test"), set()),
]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: tuple[str, ...]) -> set[str]:
    project = PYPROJECT["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {_canonical(Requirement(r).name) for r in requirements}


@functools.cache
def imported(directory: str) -> dict[str, set[str]]:
    """Top-level third-party module -> the files that import it."""
    base = ROOT / directory
    # Modules the directory's own scripts import by their bare name (pytest's rootdir and a
    # script's own folder are on sys.path).
    own = {p.stem for p in base.glob("*.py")} | {"flask_distlimit", "tests", "example_app", "bench"}
    found: dict[str, set[str]] = {}
    for path in base.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own:
                    found.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    return found


@functools.cache
def _providers() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def distributions(module: str) -> set[str]:
    provided = _providers().get(module)
    return {_canonical(d) for d in provided} if provided else {_canonical(module)}


@pytest.mark.slow
@pytest.mark.parametrize(("directory", "extras", "running"), SCOPES, ids=[s[0] for s in SCOPES])
def test_every_import_is_declared(
    directory: str, extras: tuple[str, ...], running: set[str]
) -> None:
    allowed = declared(extras) | running
    undeclared = {}
    for module, files in sorted(imported(directory).items()):
        if module in THROUGH:
            parent = THROUGH[module]
            assert parent is None or parent in allowed, (module, parent)
            continue
        if not distributions(module) & allowed:
            undeclared[module] = sorted(files)[:3]
    lists = " + ".join(["dependencies", *(f"[{e}]" for e in extras)])
    assert not undeclared, (
        f"{directory}/ imports modules that {lists} in pyproject.toml do not declare (a fresh "
        f"venv would not have them): {undeclared}"
    )


def test_the_scan_sees_the_imports_it_must() -> None:
    tests = imported("tests")
    assert {"pytest", "redis", "flask", "cryptography", "hypothesis"} <= set(tests)
    assert "redis" in imported("flask_distlimit")
    assert "redis" in imported("example_app")
