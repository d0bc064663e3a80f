"""The version of Flask-DistLimit: the one place it is written.

``pyproject.toml`` reads it from here when a wheel or an sdist is built
(``[tool.setuptools.dynamic]``), so the distribution's metadata
(``importlib.metadata.version("Flask-DistLimit")``) and ``flask_distlimit.__version__`` never
disagree, and a checkout used through ``PYTHONPATH`` knows its version too.
``docs/releasing.md`` says when and how it changes; ``docs/changelog.md`` what each version holds.
"""

from __future__ import annotations

__all__ = ["__version__"]

#: PEP 440: ``X.Y.Z`` for a release, ``X.Y.Z.devN`` between releases.
__version__ = "0.2.0.dev0"
