"""docs/request-flow.md follows the code: every module one ordinary request crosses is named in
its walk, and the request crosses no more package calls than it did (issue 36 aims at 35).

The ordinary request is the page's own example: an anonymous client, one global limit, one route
limit, one Redis node (a real redis-server), SECRET_KEY set; the fourth request is traced, so
the plans are bound, the script loaded and the pool warm.
"""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from flask import Flask

from flask_distlimit import Limiter
from tests.servers import RedisProcess

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "/flask_distlimit/"

#: Package calls (Python functions of flask_distlimit entered, a record's generated constructor
#: included) of the traced request: a ratchet, lowered as the request path is simplified (73
#: when it was written, then 66 and 58; 52 once generated constructors were counted too (the
#: earlier figures missed two named tuples'); 49 once the storage chain lost
#: RedisStorage._run, Pipeline._lead, Pipeline._read, Call.__init__ and key_if_armed; 47 with no
#: call to the verified identities' readers for a client no hook can vouch for; 32 once the
#: gate decided itself, a calm breaker was read, the pipeline's leader sent and read in call(),
#: a cached identity tag was a dict lookup and the metrics were told once per storage call).
#: Room for the garbage collector's callbacks and a heartbeat that falls due: issue 36's 35.
MOST_CALLS = 35


def _trace_one_request(url: str) -> list[str]:
    app = Flask(__name__)
    app.config.update(
        SECRET_KEY="request-flow",
        DISTLIMIT_STORAGE_URL=url,
        DISTLIMIT_KEY_PREFIX="request-flow",
        DISTLIMIT_GLOBAL_LIMITS="100/minute",
    )
    limiter = Limiter(app)

    @app.get("/search")
    @limiter.limit("10/second")
    def search() -> str:
        return "ok"

    client = app.test_client()
    for _ in range(3):
        client.get("/search").close()
    crossed: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if PACKAGE in code.co_filename:
            crossed.append(code.co_filename.split(PACKAGE, 1)[1])
        elif code.co_filename.startswith("<"):
            # A record's generated constructor (dataclass, NamedTuple, frozen.slot_init) is
            # written outside the package's files, but it is a call of the package all the same.
            owner = frame.f_locals.get("self", frame.f_locals.get("_cls"))
            module = (owner if isinstance(owner, type) else type(owner)).__module__
            if module.startswith("flask_distlimit."):
                crossed.append(module.removeprefix("flask_distlimit.").replace(".", "/") + ".py")

    gc.collect()  # a collection inside the trace adds the calls of what it finalizes (CI: 2)
    gc.disable()
    sys.setprofile(profile)
    try:
        response = client.get("/search")
        response.close()
    finally:
        sys.setprofile(None)
        gc.enable()
    assert response.status_code == 200
    return crossed


def test_the_walk_names_every_module_the_request_crosses(redis_server: RedisProcess) -> None:
    crossed = _trace_one_request(redis_server.url)
    text = (ROOT / "docs" / "request-flow.md").read_text()
    walk = text[text.index("\n## The request\n") : text.index("\n## Where to change what")]
    named = set(re.findall(r"`([a-z_/]+\.py)`", walk))
    missing = sorted(set(crossed) - named)
    assert not missing, f"docs/request-flow.md's walk never names {missing}"
    assert len(crossed) <= MOST_CALLS, (
        f"one ordinary request now makes {len(crossed)} package calls (at most {MOST_CALLS}): "
        "simplify the path, or raise MOST_CALLS and say why in the changelog"
    )
