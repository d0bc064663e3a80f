"""Every Python block of the README and the docs runs as written, or says it is a fragment.

Which blocks: every fenced block tagged ``python`` (or ``py``, ``python3``) in ``README.md`` and
``docs/**/*.md``, indented fences inside lists and admonitions included. A block's test id is its
file and its number among the file's Python blocks, from 1: ``quickstart.md:3``.

Fragments: a block whose first line is a comment ``# fragment: <what it leaves out>`` is only
compiled, and ``compile()`` must succeed. No other block is spared.

Every other block is executed as written, in a fresh module (its own namespace and its own name in
``sys.modules``; ``__file__`` and the line numbers are those of the Markdown file, so a traceback
points at the doc), twice: with the storage at ``memory://`` and at a real redis-server started by
the fixtures (flushed before the test; afterwards every key must carry a TTL). The block is
pointed at the test storage without changing what the reader sees:

1. a string literal naming the reader's local Redis, ``"redis://localhost..."``, is replaced by
   the test storage's URL;
2. every Flask app the block makes starts with ``DISTLIMIT_STORAGE_URL`` = the test storage among
   its defaults (``Flask.default_config``), so a block that configures no storage runs on Redis
   too; what the block sets itself wins, as usual;
3. the environment holds ``DISTLIMIT_STORAGE_URL`` = the test storage and no other
   ``DISTLIMIT_*`` variable, for blocks that read their settings from the environment.

Then:

- a module-level ``create_app`` without parameters is called (Flask's app factory), and every
  module-level ``test_*`` function without parameters is called (a block that shows a test runs it);
- every app's limiter must count in the test storage (``health()["storage"]``);
- for every Flask app in the namespace or from ``create_app``, every URL rule without variables is
  requested with each of its methods but HEAD and OPTIONS, several times: no response may be a 5xx.
  Counters are reset between routes (``Limiter.state(app).reset()``);
- where the block declares a limit on the route (read from its source: ``@limiter.limit(...)`` and
  ``@limiter.shared_limit(...)`` on the view, else ``DISTLIMIT_DEFAULT_LIMITS``; plus
  ``DISTLIMIT_GLOBAL_LIMITS`` and the ``anonymous`` tier of ``DISTLIMIT_TIERS`` as in effect after
  ``init_app``), the first request must pass, and one of the next, at most the smallest declared
  count plus 2, must be refused: a 429 with ``Retry-After``;
- an ``@limiter.exempt`` route is never refused and carries no rate-limit headers;
- every route the block limits at module level or in ``create_app`` must have been requested (a
  route with variables, by the block's own ``test_*`` function), so that a limit the test cannot
  reach fails here rather than passing unseen.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.datastructures import ImmutableDict
from werkzeug.exceptions import HTTPException

from flask_distlimit import Limiter, parse_rates

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PYTHON_TAGS = {"python", "py", "python3"}
OPEN_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<tag>[\w+-]*)")
FRAGMENT = re.compile(r"^# fragment\b")
FRAGMENT_WITH_REASON = re.compile(r"^# fragment: \S.{9,}")
#: The reader's local Redis, as a string literal of the block.
LOCAL_REDIS = re.compile(r"""(["'])redis://localhost(?::\d+)?(?:/\d*)?\1""")
#: Beyond the smallest declared count, how many more requests may pass before one is refused
#: (a window boundary crossed during the burst).
SLACK = 2
UNLIMITED_PROBES = 3
RATE_LIMIT_HEADERS = ("X-RateLimit-Limit", "RateLimit-Policy", "RateLimit")


@dataclass(frozen=True)
class Block:
    path: Path
    number: int  # among the file's Python blocks, from 1
    line: int  # of the block's first code line in the file, from 1
    code: str

    @property
    def name(self) -> str:
        base = DOCS if self.path.is_relative_to(DOCS) else ROOT
        return f"{self.path.relative_to(base).as_posix()}:{self.number}"

    @property
    def is_fragment(self) -> bool:
        return bool(FRAGMENT.match(self.code))


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def python_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opened = OPEN_FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        indent, fence, tag = opened["indent"], opened["fence"], opened["tag"].lower()
        close = re.compile(rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = i + 1
        while end < len(lines) and not close.match(lines[end]):
            end += 1
        if tag in PYTHON_TAGS:
            body = [
                line[len(indent) :] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1 : end]
            ]
            blocks.append(Block(path, len(blocks) + 1, i + 2, "\n".join(body) + "\n"))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for path in markdown_files() for block in python_blocks(path)]
RUNNABLE = [pytest.param(b, id=b.name) for b in ALL_BLOCKS if not b.is_fragment]
FRAGMENTS = [pytest.param(b, id=b.name) for b in ALL_BLOCKS if b.is_fragment]


def compiled(block: Block, code: str | None = None) -> types.CodeType:
    # Blank lines in front keep the Markdown file's line numbers in tracebacks.
    return compile("\n" * (block.line - 1) + (code or block.code), str(block.path), "exec")


# -- what the block declares, read from its source ------------------------------------------------


@dataclass
class Declared:
    rates: list[str] = field(default_factory=list)
    exempt: bool = False
    #: the route has limits with a key_func: one answering None skips its limit for a request
    #: (Flask-Limiter's opt-out), so they are not counted on to refuse an anonymous client
    keyed: bool = False


ROUTE_DECORATORS = {"route", "get", "post", "put", "patch", "delete"}


def declared_routes(code: str) -> dict[str, Declared]:
    """Path -> the limits and exemption its view's decorators declare, for the views defined at
    module level or inside ``create_app``."""
    tree = ast.parse(code)
    views: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            views.append(node)
            if node.name == "create_app":
                views.extend(
                    n
                    for n in ast.walk(node)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not node
                )
    routes: dict[str, Declared] = {}
    for view in views:
        paths: list[str] = []
        declared = Declared()
        for dec in view.decorator_list:
            if isinstance(dec, ast.Attribute) and dec.attr == "exempt":
                declared.exempt = True
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            first = dec.args[0] if dec.args else None
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            if dec.func.attr in ROUTE_DECORATORS:
                paths.append(first.value)
            elif dec.func.attr in ("limit", "shared_limit"):
                if any(k.arg == "key_func" for k in dec.keywords):
                    declared.keyed = True
                else:
                    declared.rates.append(first.value)
        for path in paths:
            routes[path] = declared
    return routes


def smallest_count(app: Flask, declared: Declared | None) -> int | None:
    """The smallest count among the limits that apply to an anonymous client of the route."""
    config = app.config
    if not config.get("DISTLIMIT_ENABLED", True):
        return None
    if declared and (declared.rates or declared.keyed):
        texts = list(declared.rates)
    else:
        texts = [config.get("DISTLIMIT_DEFAULT_LIMITS") or ""]
    texts.append(config.get("DISTLIMIT_GLOBAL_LIMITS") or "")
    texts.append((config.get("DISTLIMIT_TIERS") or {}).get("anonymous") or "")
    counts = [rate.amount for text in texts if text for rate in parse_rates(text)]
    return min(counts, default=None)


# -- running a block ------------------------------------------------------------------------------


STORAGES = [
    pytest.param("memory", id="memory"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]


@pytest.fixture
def storage_url(request: pytest.FixtureRequest) -> str:
    """The URL of the test storage: ``memory://``, or the session's redis-server (flushed)."""
    if request.param == "memory":
        return "memory://"
    request.getfixturevalue("redis_client")  # flushed now, every key checked for a TTL after
    return str(request.getfixturevalue("redis_server").url)


@pytest.fixture
def pointed_at(storage_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Rules 2 and 3 of the module docstring: app defaults and environment name the storage."""
    defaults = ImmutableDict({**Flask.default_config, "DISTLIMIT_STORAGE_URL": storage_url})
    monkeypatch.setattr(Flask, "default_config", defaults)
    for name in [n for n in os.environ if n.startswith("DISTLIMIT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DISTLIMIT_STORAGE_URL", storage_url)
    return storage_url


def execute(block: Block, storage_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    code = LOCAL_REDIS.sub(lambda _: repr(storage_url), block.code)
    name = "docs_example_" + re.sub(r"\W", "_", block.name)
    module = types.ModuleType(name)
    module.__file__ = str(block.path)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compiled(block, code), module.__dict__)
    return module.__dict__


def own_functions(namespace: dict[str, Any]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Module-level functions of the block that take no arguments."""
    for key, value in list(namespace.items()):
        if (
            inspect.isfunction(value)
            and value.__module__ == namespace["__name__"]
            and not any(
                p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                for p in inspect.signature(value).parameters.values()
            )
        ):
            yield key, value


def probe(app: Flask, path: str, method: str, declared: Declared | None) -> None:
    where = f"{method} {path}"
    if "distlimit" in app.extensions:
        Limiter.state(app).reset()
    client = app.test_client()
    count = smallest_count(app, declared)
    if declared is not None and declared.exempt:
        count = None
    budget = UNLIMITED_PROBES if count is None else count + 1 + SLACK
    statuses: list[int] = []
    for _ in range(budget):
        response = client.open(path, method=method)
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{where} answered {statuses}: see the captured log"
        if declared is not None and declared.exempt:
            found = [h for h in RATE_LIMIT_HEADERS if h in response.headers]
            assert not found, f"{where} is exempt but sent {found}"
        if response.status_code == 429:
            assert count is not None, f"{where} has no declared limit but answered {statuses}"
            assert "Retry-After" in response.headers, f"{where}: a 429 without Retry-After"
            break
    if count is not None:
        assert statuses[0] != 429, f"{where} refused its first request"
        assert statuses[-1] == 429, (
            f"{where} declares a limit of {count} per window but was never refused in "
            f"{len(statuses)} requests: {statuses}"
        )


def check_apps(block: Block, namespace: dict[str, Any], storage_url: str) -> set[str]:
    """Probe every app of the namespace; answer the paths requested."""
    apps = [value for value in namespace.values() if isinstance(value, Flask)]
    for name, func in own_functions(namespace):
        if name == "create_app":
            app = func()
            assert isinstance(app, Flask), f"create_app() returned {app!r}"
            apps.append(app)
    routes = declared_routes(block.code)
    probed: set[str] = set()
    for app in apps:
        if "distlimit" in app.extensions:
            scheme = Limiter.state(app).health()["storage"]
            assert scheme == storage_url.split(":")[0], f"{block.name} counts in {scheme}"
        for rule in app.url_map.iter_rules():
            if rule.endpoint == "static" or rule.arguments:
                continue
            for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
                probe(app, rule.rule, method, routes.get(rule.rule))
                probed.add(rule.rule)
    return probed


def run_and_check(block: Block, storage_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    namespace = execute(block, storage_url, monkeypatch)
    asked: list[tuple[Flask, str, str]] = []  # what the block's own tests request
    opened = FlaskClient.open

    def recording(client: FlaskClient, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], str):
            asked.append((client.application, args[0], kwargs.get("method", "GET")))
        return opened(client, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(FlaskClient, "open", recording)
        for name, func in own_functions(namespace):
            if name.startswith("test_"):
                func()
    probed = check_apps(block, namespace, storage_url)
    for app, path, method in asked:  # a route with variables is reached by a test's request
        with contextlib.suppress(HTTPException):
            adapter = app.url_map.bind("localhost")
            probed.add(adapter.match(path, method=method, return_rule=True)[0].rule)
    limited = {path for path, d in declared_routes(block.code).items() if d.rates}
    unreached = sorted(limited - probed)
    assert not unreached, f"{block.name} limits {unreached}, which the test could not request"


@pytest.mark.slow
@pytest.mark.parametrize("storage_url", STORAGES, indirect=True)
@pytest.mark.parametrize("block", RUNNABLE)
def test_block_runs(block: Block, pointed_at: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run_and_check(block, pointed_at, monkeypatch)


@pytest.mark.parametrize("block", FRAGMENTS)
def test_fragment_compiles(block: Block) -> None:
    first = block.code.splitlines()[0]
    assert FRAGMENT_WITH_REASON.match(first), (
        f"{block.name}: a fragment's first line says what it leaves out, "
        f"e.g. '# fragment: app and limiter are yours', got {first!r}"
    )
    compiled(block)


def test_every_python_block_is_collected() -> None:
    """A count independent of the collector: a fence the collector missed is a block nobody runs."""
    fences = sum(
        1
        for path in markdown_files()
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip().lower().lstrip("`~").strip() in PYTHON_TAGS
        and line.strip()[:3] in ("```", "~~~")
    )
    assert len(ALL_BLOCKS) == fences
    assert {b.name for b in ALL_BLOCKS} >= {"README.md:1", "index.md:1", "quickstart.md:4"}


# -- the checks themselves can fail ---------------------------------------------------------------

HEAD = """\
from flask import Flask
from flask_distlimit import Limiter

app = Flask(__name__)
"""
NEVER_REFUSED = (
    HEAD
    + """\
limiter = Limiter(app)

@app.get("/hello")
@limiter.limit("3/minute", exempt_when=lambda: True)  # skipped on every request
def hello():
    return "hi"
"""
)
BROKEN = (
    HEAD
    + """\
limiter = Limiter(app)

@app.get("/hello")
@limiter.limit("3/minute")
def hello():
    return None                     # a view must return a response: 500
"""
)
UNREACHABLE = (
    HEAD
    + """\
limiter = Limiter(app)

@app.get("/items/<int:item_id>")
@limiter.limit("3/minute")
def item(item_id):
    return "hi"
"""
)


@pytest.mark.parametrize("storage_url", STORAGES[:1], indirect=True)
@pytest.mark.parametrize(
    ("code", "failure"),
    [
        pytest.param(NEVER_REFUSED, "was never refused", id="limit-never-refuses"),
        pytest.param(BROKEN, "answered [500]", id="5xx"),
        pytest.param(UNREACHABLE, "which the test could not request", id="limit-unreachable"),
    ],
)
def test_a_block_that_does_not_do_what_it_says_fails(
    code: str, failure: str, pointed_at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = Block(ROOT / "README.md", 0, 1, code)
    with pytest.raises(AssertionError, match=re.escape(failure)):
        run_and_check(block, pointed_at, monkeypatch)
