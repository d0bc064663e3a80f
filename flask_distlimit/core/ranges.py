"""A setting's bad value (:func:`invalid`) and numeric ranges (:class:`Range`), said alike."""

from __future__ import annotations

from typing import NamedTuple

from flask_distlimit.errors import ConfigurationError


def invalid(key: str, value: object, accepted: str) -> ConfigurationError:
    """The error of ``key = value``, ``accepted`` saying what the key takes."""
    return ConfigurationError(f"{key} = {value!r} is not valid. {accepted}")


class Range(NamedTuple):
    """The values a numeric key accepts: ``minimum`` (excluded when ``strict``) to ``maximum``;
    ``meaning`` ends the message of a bad value."""

    integer: bool
    minimum: float
    maximum: float
    meaning: str = ""
    strict: bool = False

    def read(self, key: str, value: object) -> float:
        """``value``: a number in this range (an ``int`` for an integer key; NaN and infinities
        are out of every range); bools and strings are refused."""
        kind = "an integer" if self.integer else "a number"
        bound = f"> {self.minimum:g}" if self.strict else f">= {self.minimum:g}"
        accepted = f"Use {kind} {bound} and <= {self.maximum:.15g}{self.meaning}."
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            raise invalid(key, value, accepted)
        if not self.minimum <= value <= self.maximum or (self.strict and value == self.minimum):
            raise invalid(key, value, accepted)
        return value if self.integer else float(value)
