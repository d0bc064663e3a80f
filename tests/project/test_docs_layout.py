"""The docs a newcomer reads first are small enough to learn from.

- docs/api.md reads as text without a site build: every public name, and every object of a
  mkdocstrings directive (``::: name``, which only the built site expands), is named in a
  sentence, so a reader on GitHub or in an editor sees what each entry is;
- docs/configuration.md opens with the six keys a typical app sets, then every key by concern;
- the quickstart names the default algorithm and says how to get a Redis.
"""

from __future__ import annotations

import re
from pathlib import Path

import flask_distlimit
import flask_distlimit.testing

ROOT = Path(__file__).resolve().parents[2]
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


CONFIGURATION = ROOT / "docs" / "configuration.md"
KEY_HEADING = re.compile(r"^### `(DISTLIMIT_[A-Z0-9_]+)`\s*$", re.MULTILINE)


def test_configuration_opens_with_six_keys_then_groups_the_rest() -> None:
    """A newcomer reads six keys first; the reference below groups every key by concern."""
    text = CONFIGURATION.read_text()
    groups = re.split(r"^## ", text, flags=re.MULTILINE)
    assert groups[1].startswith("The six keys a typical app sets\n"), groups[1][:80]
    table = [line for line in groups[1].splitlines() if line.startswith("| [`DISTLIMIT_")]
    six = [re.match(r"\| \[`(DISTLIMIT_[A-Z0-9_]+)`\]\(#([a-z0-9_]+)\)", row) for row in table]
    assert len(six) == 6 and all(six), table
    headings = set(KEY_HEADING.findall(text))
    for found in six:
        assert found is not None
        assert found[1] in headings and found[2] == found[1].lower(), found[0]
    # Every key's own section sits in a group of the reference, and the index names them all.
    in_groups = KEY_HEADING.findall("".join(f"## {g}" for g in groups[3:]))
    assert not KEY_HEADING.findall(groups[1] + groups[2]), "keys documented before the groups"
    assert sorted(in_groups) == sorted(headings)
    index = groups[2]
    assert all(f"`{k}`" in index for k in headings), sorted(k for k in headings if k not in index)


QUICKSTART = ROOT / "docs" / "quickstart.md"


def test_quickstart_names_the_default_algorithm_and_how_to_get_redis() -> None:
    text = QUICKSTART.read_text()
    assert "sliding window counter" in text and "fixed window" in text
    redis_section = text[text.index("## 4. Redis") : text.index("## 5.")]
    assert "redis-server" in redis_section and "example app" in redis_section
    assert "waits_a_minute" not in text  # its test advances two minutes, and says why
