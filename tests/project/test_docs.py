"""The documentation: the site builds with ``mkdocs build --strict`` (every warning is an error:
broken links, missing pages, bad anchors, API reference that no longer matches the code), every
``DISTLIMIT_*`` key the package reads is documented exactly once, the README keeps its two
commands, and every pointer from the code to a named part of a page or docstring finds it."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flask_distlimit.config import KNOWN_KEYS

ROOT = Path(__file__).resolve().parents[2]
KEY = re.compile(r"[\"'](DISTLIMIT_[A-Z0-9_]+)[\"']")
HEADING = re.compile(r"^### `(DISTLIMIT_[A-Z0-9_]+)`\s*$", re.MULTILINE)


@pytest.mark.slow
def test_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "api" / "index.html").read_text().count("Limiter") > 5


def test_every_setting_is_documented_once() -> None:
    read = set(KNOWN_KEYS) | {  # the keys init_app reads, and any other the package names
        key
        for path in (ROOT / "flask_distlimit").rglob("*.py")
        for key in KEY.findall(path.read_text())
    }
    documented = HEADING.findall((ROOT / "docs" / "configuration.md").read_text())
    assert read, "no DISTLIMIT_ keys found in the package"
    missing = sorted(read - set(documented))
    assert not missing, f"settings read by the package but not in docs/configuration.md: {missing}"
    twice = sorted({k for k in documented if documented.count(k) > 1})
    assert not twice, f"settings documented more than once: {twice}"
    unknown = sorted(set(documented) - read)
    assert not unknown, f"documented settings the package does not read: {unknown}"


def test_readme_has_its_two_commands() -> None:
    commands = [
        line.strip()
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("    python -m pip install")
    ]
    assert commands == [
        'python -m pip install -q -e ".[example]" && python -m example_app',
        'python -m pip install -q -e ".[test]" && python -m pytest',
    ]
    pyproject = (ROOT / "pyproject.toml").read_text()
    example = re.search(r"^example = \[(.*?)\]", pyproject, re.MULTILINE | re.DOTALL)
    assert example, "pyproject.toml has no 'example' extra"
    assert '"pyjwt' in example[1] and '"gunicorn' in example[1]


#: A pointer from the code to a named part of a page (``docs/failure-modes.md, "One retry"``) or
#: of its own module's docstring (``module docstring, "Memory"``, ``"Memory" in the module
#: docstring``).
PAGE_SECTION = re.compile(r'(docs/[a-z_/-]+\.md),? "([^"]+)"')
DOCSTRING_SECTION = re.compile(
    r'module docstring(?:\'s|,) ?"([^"]+)"|"([^"]+)" in the module docstring'
)


def test_every_pointer_from_the_code_finds_what_it_names() -> None:
    """Rationale moves from module docstrings to docs/: a comment that still sends a reader to
    a part of a docstring or page that is gone fails here."""

    def flat(text: str) -> str:
        return " ".join(text.split()).lower()

    lost = []
    for path in sorted((ROOT / "flask_distlimit").rglob("*.py")):
        source = path.read_text()
        text = " ".join(source.split())
        doc = flat(ast.get_docstring(ast.parse(source)) or "")
        where = path.relative_to(ROOT)
        for page, part in PAGE_SECTION.findall(text):
            target = ROOT / page
            if not target.exists() or flat(part) not in flat(target.read_text()):
                lost.append(f"{where}: {page}, {part!r}")
        for first, second in DOCSTRING_SECTION.findall(text):
            part = first or second
            if flat(part) not in doc:
                lost.append(f"{where}: its module docstring, {part!r}")
    assert not lost, "pointers to parts that are not there:\n" + "\n".join(lost)
