"""MkDocs hook: render the Sphinx roles of the package's docstrings in the API reference.

The docstrings cross-reference with Sphinx roles (``:class:`~flask_distlimit.Limiter```), which
mkdocstrings leaves as text. This turns ``:class:<code>~a.b.C</code>`` into ``<code>C</code>``
(and keeps the full path without the ``~``), as Sphinx would show it, and a paragraph ending in
reStructuredText's literal-block marker ``::`` (the block itself renders as code) into ``:``.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|data|meth|attr|exc|mod|obj|const):<code>(~?)([^<]*)</code>")


def _name(match: re.Match[str]) -> str:
    short, target = match[1], match[2]
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


_LITERAL_MARKER = re.compile(r"::</p>")


def on_page_content(html: str, **_: Any) -> str:
    return _LITERAL_MARKER.sub(":</p>", _ROLE.sub(_name, html))
