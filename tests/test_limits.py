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
        (" 10 / Second ; 5 PER 2 minutes ", (Rate(10, 1), Rate(5, 120))),
        ("", ()),
    ],
)
def test_accepted_forms(text: str, expected: tuple[Rate, ...]) -> None:
    assert parse_rates(text) == expected


@pytest.mark.parametrize(
    "text",
    ["banana", "0/minute", "-1/second", "10/fortnight", "10/0 seconds", "10/second;", "1.5/second",
     "10/", "/minute", "10 minute", "10/99999 days"],
)  # fmt: skip
def test_malformed_limits_raise_configuration_error(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_rates(text)
    assert isinstance(info.value, ValueError)
    assert "10/second" in str(info.value)  # the message shows the accepted forms


def test_rate_round_trips_through_str() -> None:
    for text in ["10/second", "5/30 seconds", "100/minute", "7/2 hours", "1/day"]:
        (rate,) = parse_rates(text)
        assert parse_rates(str(rate)) == (rate,)
