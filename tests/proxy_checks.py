"""The proxy-header checks of ``test_proxy_headers.py``, on whatever Flask and werkzeug run them.

Imported by the test (the newest werkzeug, in the test's own interpreter) and run as a script in
a venv with the oldest Flask and werkzeug the package accepts::

    python tests/proxy_checks.py redis://127.0.0.1:6379/0 PREFIX

It prints one JSON report: the werkzeug version, the identity of every header in :data:`CASES`
and the statuses of an attack through a real app. Only the package, Flask and werkzeug are
imported here (the venv has no pytest).
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

import flask

from flask_distlimit import Limiter
from flask_distlimit.identity import IdentityResolver, IdentitySettings

#: The real client, the outer proxy (its address appended by the inner one) and the inner proxy
#: (the app's TCP peer).
CLIENT = "198.51.100.7"
OUTER = "10.0.0.1"
INNER = "10.0.0.2"
#: An address the attacker wants to be counted as (or whose bucket it wants to spend).
VICTIM = "9.9.9.9"

#: (trusted hops, X-Forwarded-For as the app receives it, the identity counted). The client's
#: own part is everything left of the entries the proxies appended.
CASES: list[tuple[int, str | None, str]] = [
    (2, f"{CLIENT}, {OUTER}", f"ip:{CLIENT}"),
    (2, f'{VICTIM}, ", {CLIENT}, {OUTER}', f"ip:{CLIENT}"),  # the open quote of issue 10
    (2, f'"{VICTIM}, {CLIENT}, {OUTER}', f"ip:{CLIENT}"),
    (2, f'{VICTIM}\\", x", {CLIENT}, {OUTER}', f"ip:{CLIENT}"),
    (2, f'"a,b", {CLIENT},{OUTER}', f"ip:{CLIENT}"),
    (2, f"{VICTIM},, {CLIENT}, {OUTER}", f"ip:{CLIENT}"),
    (2, f" {CLIENT}\t ,\t{OUTER} ", f"ip:{CLIENT}"),
    (2, f"[2001:db8::7]:443, {OUTER}", "ip:2001:db8::/64"),
    (2, f"{CLIENT}:5555, {OUTER}", f"ip:{CLIENT}"),
    (1, f'{VICTIM}, ", {CLIENT}', f"ip:{CLIENT}"),
    (1, f'{VICTIM}, "', f"ip:invalid-via:{INNER}"),
    (2, f"junk, {OUTER}", f"ip:invalid-via:{OUTER}"),
    (2, f"unknown, {OUTER}", f"ip:invalid-via:{OUTER}"),
    (2, f'"{CLIENT}", {OUTER}', f"ip:invalid-via:{OUTER}"),
    (2, f", {OUTER}", f"ip:invalid-via:{OUTER}"),
    (2, f"{OUTER}", f"ip:invalid-via:{OUTER}"),  # fewer entries than trusted hops
    (2, "junk, junk", f"ip:invalid-via:{INNER}"),
    (2, None, f"ip:{INNER}"),  # nothing forwarded: the peer itself is the client
    (1, "", f"ip:invalid-via:{INNER}"),  # forwarded, but no address in it
    (0, f"{VICTIM}, {CLIENT}", f"ip:{INNER}"),
]


def identities() -> list[str]:
    """The identity counted for each of :data:`CASES`."""
    found = []
    for hops, header, _ in CASES:
        app = flask.Flask("proxy_checks")
        app.config["DISTLIMIT_TRUSTED_PROXIES"] = hops
        resolver = IdentityResolver(IdentitySettings.from_config(app.config))
        environ: dict[str, object] = {"REMOTE_ADDR": INNER}
        if header is not None:
            environ["HTTP_X_FORWARDED_FOR"] = header
        found.append(resolver.client_ip(environ))
    return found


def attack(storage_url: str, prefix: str) -> dict[str, list[int]]:
    """Statuses through an app behind two proxies with a limit of 3 per minute per client."""
    app = flask.Flask("proxy_attack")
    app.config.update(
        DISTLIMIT_STORAGE_URL=storage_url,
        DISTLIMIT_KEY_PREFIX=prefix,
        DISTLIMIT_TRUSTED_PROXIES=2,
        SECRET_KEY="proxy-checks-secret-0123456789abcdef",
    )
    limiter = Limiter(app)

    @app.get("/")
    @limiter.limit("3/minute")
    def index() -> str:
        return "ok"

    client = app.test_client()

    def get(header: str | None, times: int) -> list[int]:
        headers = {"X-Forwarded-For": header} if header is not None else {}
        return [
            client.get("/", headers=headers, environ_base={"REMOTE_ADDR": INNER}).status_code
            for _ in range(times)
        ]

    try:
        return {
            # the attacker (CLIENT) hides behind an open quote, naming VICTIM
            "attacker": get(f'{VICTIM}, ", {CLIENT}, {OUTER}', 4),
            "victim": get(f"{VICTIM}, {OUTER}", 1),  # a real client at VICTIM's address
            "proxy health check": get(None, 1),  # the inner proxy's own request
            "attacker, plainly": get(f"{CLIENT}, {OUTER}", 1),  # one bucket, however it is sent
            "junk": get(f"junk, {OUTER}", 4),
            "proxy health check again": get(None, 1),
            "outer proxy as a client": get(f"{OUTER}, {OUTER}", 1),
        }
    finally:
        Limiter.state(app).storage.close()


def report(storage_url: str, prefix: str) -> dict[str, object]:
    return {
        "werkzeug": version("werkzeug"),
        "flask": version("flask"),
        "identities": identities(),
        "attack": attack(storage_url, prefix),
    }


#: What :func:`report` must answer (but the versions), on every werkzeug.
EXPECTED: dict[str, object] = {
    "identities": [expected for _, _, expected in CASES],
    "attack": {
        "attacker": [200, 200, 200, 429],
        "victim": [200],
        "proxy health check": [200],
        "attacker, plainly": [429],
        "junk": [200, 200, 200, 429],
        "proxy health check again": [200],
        "outer proxy as a client": [200],
    },
}


if __name__ == "__main__":
    print(json.dumps(report(sys.argv[1], sys.argv[2])))
