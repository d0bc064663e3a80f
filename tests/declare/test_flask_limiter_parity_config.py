"""What a team moving from Flask-Limiter meets when it declares and configures limits (issue 33,
items 7, 8, 9 and 14): the behaviour adopted from Flask-Limiter, and each difference the
migration guide names, pinned; every refusal happens at declaration or ``init_app``."""

from __future__ import annotations

import pytest
from flask import Flask

from flask_distlimit import Limiter
from flask_distlimit.core.limits import Rate, parse_rates
from flask_distlimit.errors import ConfigurationError

# -- item 9: limit strings -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("2/sec", Rate(2, 1)),
        ("2/s", Rate(2, 1)),
        ("3 per 2 mins", Rate(3, 120)),
        ("4/hr", Rate(4, 3600)),
        ("5/h", Rate(5, 3600)),
        ("6/d", Rate(6, 86400)),
    ],
)
def test_short_units_flask_limiter_refuses_are_read_as_written(text: str, rate: Rate) -> None:
    assert parse_rates(text) == (rate,)


def test_m_could_be_minute_or_month_so_it_is_refused_at_declaration() -> None:
    with pytest.raises(ConfigurationError, match="could mean minute or month"):
        Limiter().limit("2/m")


def test_an_unreadable_default_limit_stops_init_app_instead_of_falling_back() -> None:
    app = Flask(__name__)
    app.config.update(DISTLIMIT_STORAGE_URL="memory://", DISTLIMIT_DEFAULT_LIMITS="2/fortnight")
    with pytest.raises(ConfigurationError, match="Unknown time unit 'fortnight'"):
        Limiter(app)
