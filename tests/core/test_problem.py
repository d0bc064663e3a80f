"""problem+json refusals (RFC 9457) as werkzeug HTTP exceptions."""

from __future__ import annotations

import json
import math

from flask import Flask
from werkzeug.exceptions import ServiceUnavailable, TooManyRequests

from flask_distlimit.core.problem import (
    QUOTA_EXCEEDED,
    TEMPORARY_REDUCED_CAPACITY,
    RateLimitExceeded,
    RateLimitUnavailable,
    retry_after_seconds,
)


def test_retry_after_is_a_whole_number_rounded_up() -> None:
    assert retry_after_seconds(0.2) == 1
    assert retry_after_seconds(0) == 1
    assert retry_after_seconds(3.0) == 3
    assert retry_after_seconds(3.000001) == 4
    assert retry_after_seconds(math.inf) == 86400


def test_429_body_and_headers() -> None:
    exc = RateLimitExceeded(
        retry_after=16.2, violated_policies=["orders:100/minute", "global:5/second"], instance="/o"
    )
    assert isinstance(exc, TooManyRequests) and exc.code == 429
    response = exc.get_response()
    assert response.status_code == 429
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.headers["Cache-Control"] == "no-store"
    assert response.headers["Retry-After"] == "17"
    body = json.loads(response.get_data())
    assert body == {
        "type": QUOTA_EXCEEDED,
        "title": RateLimitExceeded.title,
        "status": 429,
        "detail": body["detail"],
        "instance": "/o",
        "violated-policies": ["orders:100/minute", "global:5/second"],
        "retry_after": 17,
    }
    assert "17" in body["detail"] and "orders:100/minute" in body["detail"]
    assert QUOTA_EXCEEDED == "https://iana.org/assignments/http-problem-types#quota-exceeded"


def test_503_body_and_headers() -> None:
    exc = RateLimitUnavailable(retry_after=30)
    assert isinstance(exc, ServiceUnavailable) and exc.code == 503
    response = exc.get_response()
    assert response.headers["Retry-After"] == "30"
    assert response.headers["Cache-Control"] == "no-store"
    body = json.loads(response.get_data())
    assert body["type"] == TEMPORARY_REDUCED_CAPACITY
    assert TEMPORARY_REDUCED_CAPACITY.endswith("/http-problem-types#temporary-reduced-capacity")
    assert body["status"] == 503 and "instance" not in body


def test_a_503_says_why_it_refuses() -> None:
    """Its ``detail``: an outage, this process's queue, or a limit the route could not
    evaluate (the one sentence the request path and the Limiter never set up both send)."""
    details = [
        RateLimitUnavailable(retry_after=3, busy=busy, unresolved=unresolved).problem()["detail"]
        for busy, unresolved in [(False, False), (True, False), (False, True)]
    ]
    assert details == [
        "The rate-limit store is unavailable and this route refuses requests it cannot count; "
        "retry in 3 s.",
        "This server is overloaded: its rate-limit decisions queue past their budget; retry in "
        "3 s.",
        "A rate limit of this route could not be evaluated and this route refuses requests it "
        "cannot count; retry in 3 s.",
    ]


def _app() -> Flask:
    app = Flask("p")

    @app.get("/")
    def index() -> str:
        raise RateLimitExceeded(retry_after=2, violated_policies=["x"], instance="/")

    return app


def test_raised_in_a_view_it_goes_through_flask_error_handling() -> None:
    response = _app().test_client().get("/")
    assert response.status_code == 429
    assert response.mimetype == "application/problem+json"
    app = _app()

    @app.errorhandler(429)
    def handler(exc: RateLimitExceeded) -> tuple[str, int]:
        return f"wait {exc.retry_after_s}", 429

    assert app.test_client().get("/").get_data(as_text=True) == "wait 2"
