"""No module of the package touches a private attribute of redis-py, pybreaker, Flask or werkzeug.

An AST scan of every ``flask_distlimit`` module; a finding is ``file:line: expression``. It flags
``x._name`` (one leading underscore, not a dunder), and ``getattr``/``setattr``/``hasattr``/
``delattr`` of ``x, "_name"``, where ``x`` is:

- **an object from a dependency**: a name imported from one of the four packages, an attribute
  or a call of such an object (``redis.Redis(...)``), a name or ``self.attribute`` assigned
  such an object anywhere in the module, or a parameter, variable or class attribute annotated
  with a type that mentions one (``pool: redis.ConnectionPool | None``);
- **``self`` in a subclass of a dependency's class**, when the class itself never assigns or
  defines ``_name`` (an inherited private such as ``self._checkpid()``, not our own
  ``self._owner``);
- **any other object but ``self``/``cls``**, when ``_name`` is a private name the dependencies'
  own source assigns or defines (``connection._sock`` on a connection typed ``Any``).

Limits, on purpose simple and conservative: the tracking is by name per module, without flow
or scopes (a name once assigned a dependency's object is one everywhere in that module), and it
does not follow objects through return values, containers or other modules; an object of
ours passed around as ``Any`` is caught only by the third rule (a private name the dependencies
define), so a private of a dependency that none of them spells ``self._name = ...`` or
``def _name`` escapes it. :func:`findings` is run on the package before the fix in the
test below (``OLD_FINDINGS``) to show the scan can fail.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flask_distlimit"
DEPENDENCIES = ("redis", "pybreaker", "flask", "werkzeug")
_ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}
#: Names with one underscore that a dependency documents as public API.
DOCUMENTED = {
    # werkzeug.local.LocalProxy: "use _get_current_object() to get the proxied object" (the
    # Flask docs, "Notes On Proxies"; werkzeug's local.py docstring of LocalProxy).
    "_get_current_object",
}
_DEFINED = re.compile(r"(?:self\.|def |class )(_[A-Za-z0-9]\w*)")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@cache
def dependency_privates() -> frozenset[str]:
    """Private names the dependencies' own source assigns on ``self`` or defines."""
    names: set[str] = set()
    for package in DEPENDENCIES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.origin is not None, f"{package} is not installed"
        root = Path(spec.origin).parent
        files = [Path(spec.origin)] if root.name == "site-packages" else root.rglob("*.py")
        for path in files:
            names.update(_DEFINED.findall(path.read_text(encoding="utf-8", errors="replace")))
    return frozenset(n for n in names if _private(n))


class _Scan(ast.NodeVisitor):
    def __init__(self, tree: ast.Module) -> None:
        self.names: set[str] = set()  # names bound to a dependency or its objects
        self.self_attrs: set[str] = set()  # self.X holding a dependency's object
        self.findings: list[tuple[int, str]] = []
        self._collect(tree)

    # -- what comes from a dependency --------------------------------------------------------

    def _collect(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in DEPENDENCIES:
                        self.names.add((alias.asname or alias.name).split(".")[0])
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.level == 0
                and node.module.split(".")[0] in DEPENDENCIES
            ):
                self.names.update(a.asname or a.name for a in node.names)
        for _ in range(3):  # assignments of assignments: a few rounds reach a fixed point
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and self.tainted(node.value):
                    for target in node.targets:
                        self._bind(target)
                elif isinstance(node, ast.AnnAssign) and (
                    self.mentions(node.annotation)
                    or (node.value is not None and self.tainted(node.value))
                ):
                    self._bind(node.target)
                elif isinstance(node, ast.arg) and node.annotation is not None:
                    if self.mentions(node.annotation):
                        self.names.add(node.arg)
                elif (
                    isinstance(node, ast.withitem)
                    and node.optional_vars is not None
                    and self.tainted(node.context_expr)
                ):
                    self._bind(node.optional_vars)

    def _bind(self, target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.names.add(target.id)
        elif isinstance(target, ast.Attribute) and _is_self(target.value):
            self.self_attrs.add(target.attr)
        elif isinstance(target, ast.Tuple):
            for element in target.elts:
                self._bind(element)

    def mentions(self, annotation: ast.expr) -> bool:
        """Does a type annotation name a dependency's type?"""
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return False
        return any(
            isinstance(node, ast.Name) and node.id in self.names for node in ast.walk(annotation)
        )

    def tainted(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.Attribute):
            if _is_self(node.value):
                return node.attr in self.self_attrs
            return self.tainted(node.value)
        if isinstance(node, ast.Call):
            return self.tainted(node.func)
        if isinstance(node, ast.BoolOp | ast.IfExp):
            parts = node.values if isinstance(node, ast.BoolOp) else [node.body, node.orelse]
            return any(self.tainted(p) for p in parts)
        return False

    # -- the checks ----------------------------------------------------------------------------

    def check(self, owner: ast.expr, name: str, line: int, own: set[str]) -> None:
        if not _private(name) or name in DOCUMENTED:
            return
        text = f"{ast.unparse(owner)}.{name}"
        if self.tainted(owner):
            self.findings.append((line, f"{text} (an object from a dependency)"))
        elif _is_self(owner):
            if own is not _NOT_A_SUBCLASS and name not in own:
                self.findings.append((line, f"{text} (inherited from a dependency's class)"))
        elif name in dependency_privates() and not _is_cls(owner):
            self.findings.append((line, f"{text} (a private name of a dependency)"))


_NOT_A_SUBCLASS: set[str] = set()


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_cls(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "cls"


def _own_names(cls: ast.ClassDef) -> set[str]:
    """Names a class assigns on ``self`` or defines itself."""
    own: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and _is_self(node.value):
            if isinstance(node.ctx, ast.Store):
                own.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        elif isinstance(node, ast.Assign):
            own.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return own


def _scan(tree: ast.Module) -> list[tuple[int, str]]:
    scan = _Scan(tree)
    classes: list[tuple[ast.ClassDef, set[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            subclass = any(scan.tainted(base) for base in node.bases)
            classes.append((node, _own_names(node) if subclass else _NOT_A_SUBCLASS))
            # class-level annotations: ``client: redis.Redis`` makes ``self.client`` one
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and scan.mentions(item.annotation)
                ):
                    scan.self_attrs.add(item.target.id)

    def own_of(node: ast.AST) -> set[str]:
        found = _NOT_A_SUBCLASS
        for cls, own in classes:
            if cls.lineno <= node.lineno <= (cls.end_lineno or cls.lineno):  # type: ignore[attr-defined]
                found = own  # the innermost enclosing class wins (walk order: outer first)
        return found

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            scan.check(node.value, node.attr, node.lineno, own_of(node))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ACCESSORS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            scan.check(node.args[0], node.args[1].value, node.lineno, own_of(node))
    return sorted(scan.findings)


def findings(package: Path = PACKAGE) -> Iterator[str]:
    """``file:line: expression (why)`` for every private access found under ``package``."""
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, what in _scan(tree):
            yield f"{path.relative_to(package.parent)}:{line}: {what}"


@pytest.mark.slow
def test_no_module_touches_a_private_attribute_of_a_dependency() -> None:
    found = list(findings())
    assert not found, "private attributes of dependencies used:\n" + "\n".join(found)


# What the scan reports on the modules as they were before they moved to public APIs
# (commit 07716bc): the scan must see each kind of access.
OLD_CODE = {
    "lean_pool.py": """
import redis
class _LeanPool(redis.BlockingConnectionPool):
    def reset(self):
        self._ready = 1
    def checkout(self, deadline):
        if self._ready:
            self._checkpid()
""",
    "fresh.py": """
from typing import Any
def _fresh(connection: Any) -> bool:
    sock = connection._sock
    return connection._parser.parse_error("x")
""",
    "breaker.py": """
import pybreaker
class Breaker:
    def __init__(self):
        self._cb = pybreaker.CircuitBreaker()
    def _after_fork(self):
        self._cb._lock = None
""",
    "pools.py": """
import redis
def _pool_connections(pool: redis.ConnectionPool) -> list:
    return list(getattr(pool, "_connections", ()))
""",
    "flask_app.py": """
from flask import Flask
app = Flask("x")
app._got_first_request
""",
}


def test_the_scan_flags_what_the_old_code_did(tmp_path: Path) -> None:
    package = tmp_path / "old"
    package.mkdir()
    for name, source in OLD_CODE.items():
        (package / name).write_text(source)
    found = "\n".join(findings(package))
    for expected in (
        "lean_pool.py:8: self._checkpid (inherited",
        "fresh.py:4: connection._sock",
        "fresh.py:5: connection._parser",
        "breaker.py:7: self._cb._lock (an object from a dependency)",
        "pools.py:4: pool._connections (an object from a dependency)",
        "flask_app.py:4: app._got_first_request",
    ):
        assert expected in found, f"{expected!r} not in:\n{found}"
    assert "self._ready" not in found  # the subclass's own attribute
