"""The recipes of docs/limits.md are safe as written: each block is taken from the doc itself,
run on a fake clock, and attacked the way the review attacked it.

- Login (``deduct_when`` + ``limiter.clear``): the old recipe counted failures per address and
  cleared them on any success, so an attacker with an account of their own reset the counter
  at will (200 wrong guesses a minute against ``5/minute``). Now a success clears only the
  account it proved, and an address limit is never cleared.
- Per-tenant plans: the old recipe read the tenant from a header the client sends and gave
  unknown tenants no limit. Now the tenant comes from authentication and an unknown or
  unauthenticated client gets a plan.
- Roles as tiers: the old recipe took the role from an ``X-Role`` header.
- ``limiter.clear()`` of a counter keyed on the client's address warns.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask, request
from flask.typing import ResponseReturnValue

import flask_distlimit
from flask_distlimit import ClearedAddressWarning, Limiter
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import clock, make_app

__all__ = ["clock"]  # a fixture used below

LIMITS_MD = Path(__file__).resolve().parents[2] / "docs" / "limits.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _block(marker: str) -> str:
    found = [b for b in BLOCK.findall(LIMITS_MD.read_text()) if marker in b]
    assert len(found) == 1, f"docs/limits.md has {len(found)} blocks with {marker!r}"
    return str(found[0])


@pytest.fixture
def run_doc(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Run a block of docs/limits.md with every Limiter it makes on the fake clock."""

    class Clocked(Limiter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, clock=clock, **kwargs)

    monkeypatch.setattr(flask_distlimit, "Limiter", Clocked)

    def run(marker: str) -> dict[str, Any]:
        module = types.ModuleType("doc_block")
        exec(compile(_block(marker), str(LIMITS_MD), "exec"), module.__dict__)
        return module.__dict__

    yield run


@pytest.mark.slow
def test_the_login_recipe_cannot_be_reset_by_an_attacker_with_an_account(
    run_doc: Any, clock: FakeClock
) -> None:
    namespace = run_doc('scope="login-account"')
    app: Flask = namespace["app"]
    namespace["PASSWORDS"]["mallory"] = "own-password"  # the attacker's own account
    client = app.test_client()
    reached = 0  # wrong guesses on alice's account that reached the password check
    for _ in range(40):
        for _ in range(4):
            status = client.post("/login", data={"username": "alice", "password": "guess"})
            reached += status.status_code == 401
        client.post("/login", data={"username": "mallory", "password": "own-password"})
    assert reached == 5  # 5/minute for alice's account, whatever mallory does
    clock.advance(120.0)
    ok = client.post("/login", data={"username": "alice", "password": "sesame"})
    assert ok.status_code == 200


def test_the_login_recipe_counts_an_attempt_that_fails_with_an_error(run_doc: Any) -> None:
    """A 500 is no success: it keeps its charge (a test of 401 alone gave every one back)."""
    namespace = run_doc('scope="login-account"')

    class Broken(dict[str, str]):
        def get(self, *args: Any) -> Any:
            raise RuntimeError("the user store fails on this input")

    namespace["PASSWORDS"] = Broken()
    client = namespace["app"].test_client()
    statuses = [
        client.post("/login", data={"username": "alice", "password": "x"}).status_code
        for _ in range(8)
    ]
    assert statuses == [500] * 5 + [429] * 3


def test_the_login_recipe_keeps_an_address_limit_over_every_account(run_doc: Any) -> None:
    app: Flask = run_doc('scope="login-account"')["app"]
    client = app.test_client()
    statuses = [
        client.post("/login", data={"username": f"user{i}", "password": "x"}).status_code
        for i in range(30)
    ]
    assert statuses.count(401) == 20 and statuses[20:] == [429] * 10


@pytest.mark.slow
def test_the_tenant_recipe_takes_the_tenant_from_authentication(run_doc: Any) -> None:
    app: Flask = run_doc("def plan_of_tenant")["app"]
    client = app.test_client()

    def burst(headers: dict[str, str], n: int) -> int:
        return sum(client.get("/reports", headers=headers).status_code == 200 for _ in range(n))

    # A forged header is no tenant: the unauthenticated plan, 5/minute per address.
    assert burst({"X-Tenant": "initech"}, 20) == 5
    assert burst({"Authorization": "Bearer forged"}, 20) == 0  # the same address, spent
    assert burst({"Authorization": "Bearer acme-token"}, 120) == 100


def test_the_tenant_recipe_gives_an_unknown_tenant_a_plan(run_doc: Any) -> None:
    namespace = run_doc("def plan_of_tenant")
    namespace["TOKENS"]["new-token"] = "newco"  # authenticated, not in PLANS yet
    client = namespace["app"].test_client()
    codes = [
        client.get("/reports", headers={"Authorization": "Bearer new-token"}).status_code
        for _ in range(15)
    ]
    assert codes.count(200) == 10


def test_the_roles_recipe_takes_the_role_from_the_session(run_doc: Any) -> None:
    app: Flask = run_doc("BY_ROLE = {")["app"]
    client = app.test_client()
    forged = [
        client.get("/exports", headers={"X-User": "x", "X-Role": "admin"}).status_code
        for _ in range(15)
    ]
    assert forged.count(200) == 10  # "*": the anonymous plan, not admin's


def _clearing_app(clock: FakeClock, **limit: Any) -> Flask:
    app, limiter, _ = make_app(MemoryStorage(clock=clock), clock)

    @app.post("/login")
    @limiter.limit("5/minute", deduct_when=lambda r: r.status_code == 401, **limit)
    def login() -> ResponseReturnValue:
        limiter.clear("login")
        return "welcome"

    return app


@pytest.mark.parametrize(
    "limit",
    [{}, {"key_func": lambda: request.remote_addr}],
    ids=["own identity", "key_func address"],
)
def test_clear_of_an_address_keyed_limit_warns(clock: FakeClock, limit: dict[str, Any]) -> None:
    app = _clearing_app(clock, **limit)
    with pytest.warns(ClearedAddressWarning, match="keyed on the client's address"):
        assert app.test_client().post("/login").status_code == 200


def test_clear_of_an_account_keyed_limit_does_not_warn(clock: FakeClock) -> None:
    app = _clearing_app(clock, key_func=lambda: request.form["user"])
    assert app.test_client().post("/login", data={"user": "alice"}).status_code == 200
