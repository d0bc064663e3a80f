"""docs/api.md reads as text without a site build: every public name, and every object of a
mkdocstrings directive (``::: name``, which only the built site expands), is named in a
sentence, so a reader on GitHub or in an editor sees what each entry is."""

from __future__ import annotations

import re
from pathlib import Path

import flask_distlimit
import flask_distlimit.testing

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
DIRECTIVE = re.compile(r"^::: (\S+)\s*$")


def test_every_directive_is_named_in_prose() -> None:
    """A ``::: flask_distlimit.x.Name`` line shows nothing in plain text: the sentences around it
    must name ``Name`` (or the module ``x``) and say what it is."""
    text = API.read_text()
    targets = [m[1] for line in text.splitlines() if (m := DIRECTIVE.match(line))]
    prose = _prose(text)
    bare = [t for t in targets if f"`{t}" not in prose and f"`{t.rsplit('.', 1)[-1]}" not in prose]
    assert len(targets) > 10
    assert not bare, f"docs/api.md directives that no sentence names: {bare}"


def _prose(text: str) -> str:
    return "\n".join(
        line
        for line in text.splitlines()
        if not DIRECTIVE.match(line) and not line.startswith(("#", "    ", "```"))
    )


def test_every_public_name_is_named_in_prose() -> None:
    prose = _prose(API.read_text())
    names = [n for n in flask_distlimit.__all__ if n != "__version__"]
    names += flask_distlimit.testing.__all__
    missing = [n for n in names if f"`{n}" not in prose]
    assert not missing, f"docs/api.md never names {missing} outside a ::: directive"
