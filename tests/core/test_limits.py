from __future__ import annotations

import pytest

from flask_distlimit import ConfigurationError, Rate, parse_rates


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10/second", (Rate(10, 1),)),
        ("10/minute", (Rate(10, 60),)),
        ("10 per minute", (Rate(10, 60),)),
        ("1000/hour", (Rate(1000, 3600),)),
        ("10000/day", (Rate(10000, 86400),)),
        ("5/30 seconds", (Rate(5, 30),)),
        ("10/second;1000/hour", (Rate(10, 1), Rate(1000, 3600))),
        # Flask-Limiter's other separators: a callable's answer "2/minute, 3/hour" was refused
        # per request, and the route's failure policy answered (open: unlimited)
        ("2/minute, 3/hour|4/day", (Rate(2, 60), Rate(3, 3600), Rate(4, 86400))),
        (" 10 / Second ; 5 PER 2 minutes ", (Rate(10, 1), Rate(5, 120))),
        ("", ()),
        ("0010/second", (Rate(10, 1),)),
        ("0/minute", (Rate(0, 60),)),  # refuses every request, as Flask-Limiter reads it
        ("9999999999999 per minute", (Rate(10**12, 60),)),  # Flask-Limiter's "unlimited": 10**12
        ("1" * 5000 + "/day", (Rate(10**12, 86400),)),  # past Python's int() digits, no ValueError
        ("000" + "1" * 13 + "/day", (Rate(10**12, 86400),)),
    ],
)
def test_accepted_forms(text: str, expected: tuple[Rate, ...]) -> None:
    assert parse_rates(text) == expected


@pytest.mark.parametrize(
    "text",
    ["banana", "-1/second", "10/fortnight", "10/0 seconds", "10/second;", "10/second,",
     "1.5/second", "10/", "/minute", "10 minute", "10/99999 days"],
)  # fmt: skip
def test_malformed_limits_raise_configuration_error(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_rates(text)
    assert isinstance(info.value, ValueError)
    assert "10/second" in str(info.value)  # the message shows the accepted forms


@pytest.mark.parametrize(
    "text", ["1/" + " " * 40_000 + "!", "1" + " " * 40_000 + "per!", "1 per" + " " * 40_000 + "5"]
)
def test_a_long_run_of_spaces_is_refused_at_once(text: str) -> None:
    """A callable limit may answer text a client wrote, asked again on every request while it
    fails: the pattern never tries two whitespace runs against each other (these took 5-13 s
    each; now milliseconds)."""
    with pytest.raises(ConfigurationError):
        parse_rates(text)


def test_rate_round_trips_through_str() -> None:
    for text in ["10/second", "5/30 seconds", "100/minute", "7/2 hours", "1/day"]:
        (rate,) = parse_rates(text)
        assert parse_rates(str(rate)) == (rate,)


@pytest.mark.parametrize(
    ("algorithm", "value"),
    [
        ("sliding_window_log", "1001/minute"),
        ("gcra", "2000001/second"),
        ("gcra", "61000000/minute"),
    ],
)
def test_rates_an_algorithm_cannot_enforce_are_refused_when_declared(
    algorithm: str, value: str
) -> None:
    from flask_distlimit import Limiter

    with pytest.raises(ConfigurationError, match=algorithm):
        Limiter().limit(value, algorithm=algorithm)


def test_the_default_algorithm_is_checked_at_init_app() -> None:
    from flask import Flask

    from flask_distlimit import Limiter

    app = Flask(__name__)
    app.config["DISTLIMIT_ALGORITHM"] = "sliding_window_log"
    app.config["DISTLIMIT_GLOBAL_LIMITS"] = "2000/hour"
    with pytest.raises(ConfigurationError, match="sliding_window_log"):
        Limiter(app)

    limiter = Limiter()
    app = Flask(__name__)
    app.config["DISTLIMIT_ALGORITHM"] = "gcra"

    @app.get("/")
    @limiter.limit("5000000/second")
    def index() -> str:
        return "ok"

    with pytest.raises(ConfigurationError, match="gcra"):
        limiter.init_app(app)
    # Within bounds, both are fine.
    Limiter().limit("1000/minute", algorithm="sliding_window_log")
    Limiter().limit("1000000/second", algorithm="gcra")


def test_a_bound_limit_keeps_its_unit_checks_per_client_and_bounds_them() -> None:
    from flask_distlimit.core.decision import Check
    from flask_distlimit.declare.route_limits import _CHECKS_KEPT, bind
    from flask_distlimit.declare.specs import LimitSpec

    (bound,) = bind(
        LimitSpec("route", tuple(parse_rates("5/minute"))),
        prefix="rl",
        default_algorithm="gcra",
        label="orders",
    )
    first = bound.check("aaaa", 1)
    assert first == Check(bound.key("aaaa"), "gcra", 5, 60, 1)
    assert bound.check("aaaa", 1) is first  # kept: the same client comes back
    assert bound.check("bbbb", 1).key == bound.key("bbbb")
    assert bound.check("aaaa", 3) == Check(bound.key("aaaa"), "gcra", 5, 60, 3)  # not kept
    for i in range(3 * _CHECKS_KEPT):
        assert bound.check(f"t{i}", 1).key == bound.key(f"t{i}")
        assert len(bound._unit_checks) <= _CHECKS_KEPT
