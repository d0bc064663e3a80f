"""The release as users get it: ``python -m build`` makes an sdist and, from that sdist, a wheel;
both hold every file of the package (its Lua scripts and ``py.typed`` included) and pass
``twine check --strict``; the wheel, installed in a fresh venv, limits a request on a real Redis
and brings the ``flask distlimit`` command; the version is written once and the changelog has a
section for it. ``docs/releasing.md`` runs the same steps by hand.

The build runs on a copy of the checkout (so it leaves no ``build/`` or ``*.egg-info`` behind)
and needs the package index, as ``python -m build`` does: its isolated build environment
installs setuptools.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import tomllib
from packaging.version import Version

import flask_distlimit
from flask_distlimit._version import __version__ as written_version

ROOT = Path(__file__).resolve().parents[2]
#: Not part of a source tree: caches, builds, venvs.
JUNK = shutil.ignore_patterns(
    ".git", "__pycache__", "*.py[cod]", "*.egg-info", "build", "dist", "site", ".venv",
    ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis",
)  # fmt: skip


def package_files() -> set[str]:
    """Every file of the package in the checkout, as a path from the repository root."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "flask_distlimit").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path

    def wheel_names(self) -> set[str]:
        with zipfile.ZipFile(self.wheel) as archive:
            return set(archive.namelist())

    def sdist_names(self) -> set[str]:
        with tarfile.open(self.sdist) as archive:
            top = f"flask_distlimit-{written_version}/"
            return {m.name.removeprefix(top) for m in archive.getmembers() if m.isfile()}


def _run(
    command: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """``python -m build`` on a copy of the checkout: the sdist, then the wheel from it."""
    scratch = tmp_path_factory.mktemp("release")
    source = scratch / "source"
    shutil.copytree(ROOT, source, ignore=JUNK)
    out = scratch / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(source)])
    wheels = list(out.glob("*.whl"))
    sdists = list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    yield Built(wheels[0], sdists[0])


def test_the_version_is_written_once_and_is_pep_440() -> None:
    assert flask_distlimit.__version__ == written_version
    assert "__version__" in flask_distlimit.__all__
    assert str(Version(written_version)) == written_version  # normalized PEP 440
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "a second version string"
    assert "version" in pyproject["project"]["dynamic"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "flask_distlimit._version.__version__"}


def test_the_changelog_has_a_section_for_this_version() -> None:
    """A release (``X.Y.Z``) has its dated section; between releases, changes go to Unreleased."""
    changelog = (ROOT / "docs" / "changelog.md").read_text()
    sections = re.findall(r"^## \[([^\]]+)\]", changelog, re.MULTILINE)
    assert sections and sections[0] == "Unreleased", sections
    released = sections[1:]
    assert all(Version(s) for s in released)
    assert released == sorted(released, key=Version, reverse=True), "newest first"
    version = Version(written_version)
    if version.is_devrelease or version.is_prerelease:
        # The next release: newer than every released one.
        assert all(version > Version(s) for s in released), (written_version, released)
    else:
        assert re.search(
            rf"^## \[{re.escape(written_version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$",
            changelog,
            re.MULTILINE,
        ), f"docs/changelog.md has no dated section for {written_version}"


@pytest.mark.slow
def test_the_wheel_holds_every_package_file_and_the_right_version(built: Built) -> None:
    names = built.wheel_names()
    assert package_files() <= names, sorted(package_files() - names)
    packaged = {n for n in names if n.startswith("flask_distlimit/")}
    assert packaged == package_files(), sorted(packaged - package_files())
    assert "flask_distlimit/py.typed" in names
    assert {n for n in names if n.startswith("flask_distlimit/engine/lua/")} == {
        f"flask_distlimit/engine/lua/{p.name}"
        for p in (ROOT / "flask_distlimit" / "engine" / "lua").glob("*.lua")
    }
    dist_info = f"flask_distlimit-{written_version}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    assert built.wheel.name == f"flask_distlimit-{written_version}-py3-none-any.whl"
    with zipfile.ZipFile(built.wheel) as archive:
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert f"\nVersion: {written_version}\n" in metadata
    assert "distlimit = flask_distlimit.cli:distlimit_cli" in entry_points
    # Only the package: never the tests, the example or the benchmarks as top-level modules.
    assert {n.split("/")[0] for n in names} == {"flask_distlimit", dist_info}


@pytest.mark.slow
def test_the_sdist_holds_the_package_and_what_checks_it(built: Built) -> None:
    names = built.sdist_names()
    missing = sorted(package_files() - names)
    assert not missing, f"the sdist lacks {missing}: see MANIFEST.in and package-data"
    for needed in ("LICENSE", "README.md", "pyproject.toml", "MANIFEST.in", "mkdocs.yml",
                   "docs/changelog.md", "docs/releasing.md", "tests/conftest.py",
                   "tests/servers.py", "example_app/__main__.py", "bench/faults.py"):  # fmt: skip
        assert needed in names, needed
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.slow
def test_twine_check_strict_passes(built: Built) -> None:
    result = _run([sys.executable, "-m", "twine", "check", "--strict",
                   str(built.wheel), str(built.sdist)])  # fmt: skip
    assert result.stdout.count("PASSED") == 2, result.stdout


SMOKE = """
import importlib.metadata, json, os
from flask import Flask
import flask_distlimit
from flask_distlimit import Limiter

app = Flask("smoke")
app.config.update(SECRET_KEY="smoke-secret", DISTLIMIT_STORAGE_URL=os.environ["SMOKE_URL"],
                  DISTLIMIT_KEY_PREFIX="smoke")
limiter = Limiter(app)

@app.get("/")
@limiter.limit("2/minute", algorithm="sliding_window_log")
def index():
    return "ok"

if __name__ == "__main__":
    client = app.test_client()
    replies = [client.get("/") for _ in range(3)]
    print(json.dumps({
        "file": flask_distlimit.__file__,
        "version": flask_distlimit.__version__,
        "metadata": importlib.metadata.version("Flask-DistLimit"),
        "codes": [r.status_code for r in replies],
        "remaining": [r.headers.get("X-RateLimit-Remaining") for r in replies],
        "storage": type(app.extensions["distlimit"].storage).__name__,
    }))
"""


@pytest.mark.slow
@pytest.mark.redis
def test_the_built_wheel_limits_a_request_in_a_fresh_venv(
    built: Built, tmp_path: Path, redis_client: redis.Redis
) -> None:
    # Away from the checkout and its PYTHONPATH: only the installed wheel can be imported (and
    # pip must not take the checkout's own metadata for an installed Flask-DistLimit).
    port = redis_client.connection_pool.connection_kwargs["port"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["SMOKE_URL"] = f"redis://127.0.0.1:{port}/0"
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env=env)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          str(built.wheel)], cwd=tmp_path, env=env)  # fmt: skip
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "smoke.py").write_text(SMOKE)
    report = json.loads(_run([python, "smoke.py"], cwd=app_dir, env=env).stdout)
    assert report["file"].startswith(str(venv)), report
    assert report["version"] == report["metadata"] == written_version
    assert report["storage"] == "RedisStorage"
    assert report["codes"] == [200, 200, 429], report
    assert report["remaining"] == ["1", "0", "0"], report
    assert redis_client.keys("smoke:*"), "the counters live in the real Redis"
    # The wheel's entry point brings `flask distlimit`, and it finds those counters.
    flask = str(venv / "bin" / "flask")
    status = _run([flask, "--app", "smoke", "distlimit", "status"], cwd=app_dir, env=env)
    assert "scripts loaded:    yes" in status.stdout, status.stdout
    seen = _run([flask, "--app", "smoke", "distlimit", "inspect", "ip:127.0.0.1"],
                cwd=app_dir, env=env)  # fmt: skip
    assert "2/minute" in seen.stdout and "no counters" not in seen.stdout, seen.stdout
