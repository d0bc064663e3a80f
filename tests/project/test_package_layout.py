"""The package's layering rule, written in ``flask_distlimit/__init__.py``, holds for every import.

Every ``import`` and ``from ... import`` of every module is read from its source (module level,
under ``TYPE_CHECKING`` and inside functions alike), so an import that only runs late or only
for the type checker still counts: each is a module that must be read to understand another.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import flask_distlimit

PACKAGE = Path(flask_distlimit.__file__).parent
NAME = "flask_distlimit"


def layers() -> dict[str, int]:
    """Top-level name (module or subpackage) -> its layer's rank, from the package docstring."""
    doc = flask_distlimit.__doc__ or ""
    ranks: dict[str, int] = {}
    for rank, line in re.findall(r"^(\d+)\. (.+)$", doc, re.M):
        named, _, rest = line.partition(":")  # "``core``: what it holds" or "app: ``a``, ``b``"
        for name in re.findall(r"``(\w+)``", named) or re.findall(r"``(\w+)``", rest):
            ranks[name] = int(rank)
    ranks.setdefault("__init__", max(ranks.values()))  # "and this module"
    return ranks


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every package module ``name`` imports; ``from x import y`` is the
    module ``x.y`` when that is a module, else ``x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
                for a in node.names
            ]
        else:
            continue
        for target in targets:
            if target == NAME or target.startswith(NAME + "."):
                while target not in MODULES:  # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if target != name:
                    yield node.lineno, target


GRAPH: dict[str, set[str]] = {
    name: {target for _, target in imported(name, path)} for name, path in MODULES.items()
}


def rank(name: str, ranks: dict[str, int]) -> int:
    top = name.split(".")[1] if "." in name else "__init__"
    assert top in ranks, (
        f"{NAME}.{top} is in no layer: name it in the layer list of flask_distlimit/__init__.py"
    )
    return ranks[top]


def test_the_docstring_names_twelve_layers_and_every_top_level_name() -> None:
    ranks = layers()
    assert sorted(set(ranks.values())) == list(range(1, 13))
    tops = {n.split(".")[1] for n in MODULES if "." in n}
    assert tops <= set(ranks), tops - set(ranks)


@pytest.mark.slow
def test_no_module_imports_a_higher_layer() -> None:
    ranks = layers()
    upward = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items()
        for line, target in imported(name, path)
        if rank(target, ranks) > rank(name, ranks)
    ]
    assert not upward, "imports against the layering rule:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components: any of more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_walk_sees_function_local_and_type_checking_imports(tmp_path: Path) -> None:
    """The walk is not blind to the imports a reader meets late: the type checker's, a
    function's, a relative one."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from flask_distlimit.state import LimiterState\n"
        "def f():\n    from flask_distlimit.resilience import guard\n"
        "    from ..storage.base import Storage\n"
    )
    found = {target for _, target in imported(f"{NAME}.core.probe", probe)}
    assert found == {f"{NAME}.state", f"{NAME}.resilience.guard", f"{NAME}.storage.base"}


def test_no_module_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, f"split these by concept (one reason to change per module): {long}"
