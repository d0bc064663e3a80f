"""The rate-limit script's text, built once at import from the files of ``lua/``.

Promises: deterministic (same files, same SHA); a malformed region or helper call fails the import
with an ``AssertionError`` naming it. Regions and inlining: docs/design-notes.md, "Building the
script".
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from importlib import resources
from typing import Final

from flask_distlimit.core.algorithms import Algorithm

#: The helpers, first: their constants stay, their functions are inlined everywhere.
_COMMON: Final = "common.lua"
#: The fast path's template (filled from the algorithms' regions), second.
_FAST_PATH: Final = "fast_path.lua"
#: Then the algorithms (``<name>.lua``), and the driver, last.
_DRIVER: Final = "evaluate.lua"
#: The wrapper of the whole script: an optional request token (lua/replay.lua).
_REPLAY: Final = "replay.lua"
_BODY: Final = "--@@ BODY @@--"
#: The driver's place for its table of loaders, by algorithm code.
_LOADERS: Final = "--@@ LOADERS @@--"
#: The start of one of the fast path's sections, a text written once per algorithm.
_SECTION: Final = re.compile(r"^--@@ (\w+) @@--\n", re.MULTILINE)

#: A marker line: ``--@name`` (a region's start, or a template's place for one) or ``--@end``.
_MARKER: Final = re.compile(r"^[ \t]*--@(\w+)[ \t]*$", re.MULTILINE)
#: One of common.lua's helpers, at column 0, with its comment: name, parameters, body.
_HELPER: Final = re.compile(
    r"^(?:--[^\n]*\n)*local function (\w+)\(([\w, ]*)\)\n(.*?)^end\n", re.M | re.S
)
_NAME: Final = re.compile(r"[A-Za-z_]\w*")


def lua_text(package: str, *names: str) -> str:
    """The text of the files ``lua/<name>`` of ``package``, in order (package data)."""
    lua = resources.files(package) / "lua"
    return "".join((lua / name).read_text(encoding="utf-8") for name in names)


def _regions(text: str) -> dict[str, str]:
    """The marked regions of an algorithm file: name -> the lines from ``--@name`` to
    ``--@end`` (several regions of one name joined in order), dedented."""
    found: dict[str, str] = {}
    markers = list(_MARKER.finditer(text))
    for start, end in zip(markers[::2], markers[1::2], strict=True):
        assert end[1] == "end" != start[1], f"a region starting with {start[0]!r} lacks --@end"
        body = textwrap.dedent(text[start.end() + 1 : end.start()])
        found[start[1]] = found.get(start[1], "") + body
    return found


def _fill(template: str, places: dict[str, str]) -> str:
    """``template`` with each ``--@name`` line of ``places`` replaced by its text, indented as
    that line (an unnamed place is left out)."""

    def put(line: re.Match[str]) -> str:
        indent = line[0][: len(line[0]) - len(line[0].lstrip())]
        return textwrap.indent(textwrap.dedent(places.get(line[1], "")), indent).rstrip("\n")

    return _MARKER.sub(put, template)


def _fast_path(
    template: str, algorithms: dict[Algorithm, str], codes: Mapping[Algorithm, int], shadow: int
) -> str:
    """The fast paths: ``template``'s head, each line ``--@<section>`` replaced by the text of
    ``--@@ <section> @@--`` once per algorithm whose file has a ``--@read`` region: its regions
    in place, ``@code`` its code and ``@shadowed`` its code plus ``shadow`` (a shadow check's)."""
    head, *sections = _SECTION.split(template)
    places = dict.fromkeys(sections[::2], "")
    assert places.keys() == set(_MARKER.findall(head)), f"{_FAST_PATH}: places without sections"
    for name, text in algorithms.items():
        regions = _regions(text)
        if "read" in regions:
            for section, branch in zip(sections[::2], sections[1::2], strict=True):
                filled = _fill(branch, regions).replace("@shadowed", str(codes[name] + shadow))
                places[section] += filled.replace("@code", str(codes[name]))
    return _fill(head, places)


def _inline(text: str, helpers: dict[str, tuple[list[str], str]]) -> str:
    """``text`` with every call of a helper replaced by its body (see ``lua/common.lua``)."""
    calls = re.compile(rf"\b({'|'.join(helpers)})\(")
    lines = []
    for line in text.splitlines():
        code, dash, comment = line.partition("--")
        while found := calls.search(code):
            params, body = helpers[found[1]]
            close, args = _arguments(code, found.end())
            if body.startswith("return "):  # an expression, of plain names only
                assert all(_NAME.fullmatch(a) for a in args), f"inline {found[1]}: {line}"
                expression = _substitute(body.removeprefix("return "), params, args)
                code = f"{code[: found.start()]}({expression}){code[close:]}"
            else:  # a statement, alone on its line: its arguments bound once
                indent = code[: found.start()]
                assert not indent.strip() and not code[close:].strip(), f"inline: {line}"
                bound = f"local {', '.join(params)} = {', '.join(args)}\n{body}\n"
                code = f"{indent}do\n{textwrap.indent(bound, indent + '  ')}{indent}end"
        lines.append(code + dash + comment)
    return "\n".join(lines) + "\n"


def _substitute(expression: str, params: list[str], args: list[str]) -> str:
    """``expression`` with each parameter's name replaced by its argument's."""
    named = dict(zip(params, args, strict=True))
    return re.sub(r"\b\w+\b", lambda word: named.get(word[0], word[0]), expression)


def _arguments(code: str, start: int) -> tuple[int, list[str]]:
    """The index after the ``)`` closing a call whose arguments begin at ``start``, and the
    arguments' texts (split at the commas outside brackets)."""
    depth, args, begin = 0, [], start
    for at, char in enumerate(code[start:], start):
        if char in "([{":
            depth += 1
        elif char in ")]}" and depth:
            depth -= 1
        elif char == ")" or (char == "," and not depth):
            args.append(code[begin:at].strip())
            begin = at + 1
            if char == ")":
                return at + 1, args
    raise AssertionError(f"an unclosed call in {code!r}")


def script_parts(codes: Mapping[Algorithm, int], shadow: int) -> tuple[str, ...]:
    """The script's parts, in order: the helpers' constants, the fast path, the algorithms
    (``<name>.lua`` for each of ``codes``, in its order; the fast path's branches taken for
    its numbers, and plus ``shadow``), the driver; every helper inlined."""
    common = lua_text(__package__, _COMMON)
    helpers = {
        name: ([p.strip() for p in params.split(",")], textwrap.dedent(body).strip("\n"))
        for name, params, body in _HELPER.findall(common)
    }
    algorithms = {name: lua_text(__package__, f"{name}.lua") for name in codes}
    order = sorted(codes, key=codes.__getitem__)
    assert [codes[n] for n in order] == list(range(1, len(order) + 1)), f"codes not 1..n: {codes}"
    driver = lua_text(__package__, _DRIVER)
    assert _LOADERS in driver, f"{_DRIVER} lost its {_LOADERS} marker"
    loaders = ", ".join(f"LOAD_{name.upper()}" for name in order)
    driver = driver.replace(_LOADERS, f"local LOADERS = {{{loaders}}}")
    parts = (
        _HELPER.sub("", common),
        _fast_path(lua_text(__package__, _FAST_PATH), algorithms, codes, shadow),
        "\n".join(algorithms.values()),
        driver,
    )
    return tuple(_inline(part, helpers) for part in parts)


def script_source(parts: tuple[str, ...]) -> str:
    """The whole script: ``parts`` as the body of lua/replay.lua (the request token's wrapper)."""
    head, marker, tail = lua_text(__package__, _REPLAY).partition(_BODY)
    assert marker, f"{_REPLAY} lost its {_BODY} marker"
    return f"{head}{''.join(parts)}{tail}"
