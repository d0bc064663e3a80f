"""An attacker's view of identities and of the refusal's wire format, through the Flask test
client on memory, fakeredis and a real redis-server (``tests/distlimit_fixtures.py``).

What is proved here holds already; each test names the attack it refutes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from werkzeug.datastructures import Headers

from flask_distlimit.storage.base import Storage
from flask_distlimit.testing import FakeClock
from tests.distlimit_fixtures import backend, clock, make_app

__all__ = ["backend", "clock"]  # fixtures used below

Backend = Callable[[], Storage]

PROXY = {"REMOTE_ADDR": "10.0.0.1"}  # the one trusted proxy: the app's TCP peer


def _proxied_app(backend: Backend, clock: FakeClock) -> Callable[[Iterable[Headers]], list[int]]:
    app, limiter, _ = make_app(backend(), clock, DISTLIMIT_TRUSTED_PROXIES=1)

    @app.get("/search")
    @limiter.limit("3/minute")
    def search() -> str:
        return "ok"

    client = app.test_client()

    def statuses(each: Iterable[Headers]) -> list[int]:
        return [client.get("/search", headers=h, environ_base=PROXY).status_code for h in each]

    return statuses


def _xff(*lines: str) -> Headers:
    return Headers([("X-Forwarded-For", line) for line in lines])


def test_several_forwarded_for_lines_are_one_chain_read_from_the_right(
    backend: Backend, clock: FakeClock
) -> None:
    """A client sends X-Forwarded-For lines of its own, a new forged address each time; the proxy
    adds its own line (HAProxy's ``option forwardfor``). The server joins them in order, so the
    proxy's entry is still the rightmost: no forged line buys a fresh quota."""
    statuses = _proxied_app(backend, clock)
    forged = (_xff(f"192.0.2.{i}", f"198.51.100.{i}, 7.7.7.{i}", "203.0.113.9") for i in range(6))
    assert statuses(forged) == [200] * 3 + [429] * 3
    assert statuses([_xff("203.0.113.10")]) == [200]  # another client: its own bucket


def test_one_client_in_every_spelling_of_its_address_has_one_quota(
    backend: Backend, clock: FakeClock
) -> None:
    """IPv4-mapped IPv6, brackets, ports, blanks: one IPv4 client, one bucket."""
    statuses = _proxied_app(backend, clock)
    spellings = [
        "203.0.113.9",
        "::ffff:203.0.113.9",
        "[::FFFF:203.0.113.9]:443",
        "203.0.113.9:5555",
        " 203.0.113.9\t",
        "0:0:0:0:0:ffff:cb00:7109",
    ]
    assert statuses(_xff(s) for s in spellings) == [200] * 3 + [429] * 3


def test_an_ipv6_host_rotating_addresses_and_spellings_has_one_quota(
    backend: Backend, clock: FakeClock
) -> None:
    """Case, zone ids, brackets and every address of its /64: one bucket."""
    statuses = _proxied_app(backend, clock)
    spellings = [
        "2001:db8:1:2::1",
        "2001:DB8:1:2::FFFF",
        "[2001:db8:1:2:aaaa::1%eth0]:8443",
        "2001:0db8:0001:0002:0000:0000:0000:0009",
        "[2001:db8:1:2::1]",
    ]
    assert statuses(_xff(s) for s in spellings) == [200] * 3 + [429] * 2
    assert statuses([_xff("2001:db8:1:3::1")]) == [200]  # the next /64: another subscriber


def test_unreadable_spellings_share_one_bucket_per_proxy_never_a_fresh_one(
    backend: Backend, clock: FakeClock
) -> None:
    """Leading zeros, hex, an empty hop, a zone on IPv4: not addresses, so counted in the
    proxy's ``invalid-via`` bucket, apart from the real client 203.0.113.9."""
    statuses = _proxied_app(backend, clock)
    junk = ["001.002.003.004", "0xcb.0.113.9", "", "  ", "203.0.113.9%eth0", "203.0.113.9:"]
    assert statuses(_xff(j) for j in junk) == [200] * 3 + [429] * 3
    assert statuses([_xff("203.0.113.9")]) == [200]


def test_a_cached_denial_answers_exactly_as_the_storage_did(
    backend: Backend, clock: FakeClock
) -> None:
    """The second 429 comes from the deny cache, with no storage call: same status, headers and
    problem body as the storage's own 429 (a client cannot tell them apart), and ``Retry-After``
    is a whole number >= 1 up to the last instant of the wait."""
    app, limiter, counting = make_app(backend(), clock)

    @app.get("/report")
    @limiter.limit("2/minute")
    def report() -> str:
        return "ok"

    client = app.test_client()
    assert [client.get("/report").status_code for _ in range(2)] == [200, 200]
    before = counting.evaluations
    from_storage = client.get("/report")
    assert counting.evaluations == before + 1
    from_cache = client.get("/report")
    assert counting.evaluations == before + 1  # the deny cache answered
    for response in (from_storage, from_cache):
        assert response.status_code == 429
        assert response.headers["Content-Type"] == "application/problem+json"
        assert response.headers["Cache-Control"] == "no-store"
    assert from_cache.headers == from_storage.headers
    assert from_cache.get_data() == from_storage.get_data()
    body = json.loads(from_storage.get_data())
    wait = int(from_storage.headers["Retry-After"])
    assert body["status"] == 429 and body["retry_after"] == wait >= 1
    assert body["type"].endswith("#quota-exceeded") and body["instance"] == "/report"
    assert from_storage.headers["RateLimit"] == f'"report:2/minute";r=0;t={wait}'

    head = client.head("/report")
    assert head.status_code == 429 and head.get_data() == b""
    assert head.headers["Retry-After"] == str(wait)

    clock.advance(wait - 0.001)  # the last instant of the wait
    last = client.get("/report")
    assert last.status_code == 429 and last.headers["Retry-After"] == "1"
    clock.advance(0.001)
    assert client.get("/report").status_code == 200
