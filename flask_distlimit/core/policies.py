"""Failure policies, what answers while the storage fails: ``open``, ``closed``, ``local``.

Defined once; ``DISTLIMIT_FAILURE_POLICY``, ``on_failure=`` and the guard all check with
:func:`validate_policy`.
"""

from __future__ import annotations

from typing import Final, get_args

from flask_distlimit._typing import FailurePolicy
from flask_distlimit.errors import ConfigurationError

FAILURE_POLICIES: Final[tuple[FailurePolicy, ...]] = get_args(FailurePolicy)


def validate_policy(value: object) -> FailurePolicy:
    """``value`` as a :data:`FailurePolicy`, or :class:`ConfigurationError`."""
    if isinstance(value, str) and value in FAILURE_POLICIES:
        return value
    raise ConfigurationError(
        f"Unknown failure policy {value!r} (DISTLIMIT_FAILURE_POLICY or on_failure=). Use "
        '"open" (allow, marked degraded), "closed" (answer 503) or "local" (enforce each limit '
        "in-process, divided by DISTLIMIT_INSTANCES)."
    )
