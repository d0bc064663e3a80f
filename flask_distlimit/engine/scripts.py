"""The Lua side of the storage: the script source and its KEYS/ARGV/reply contract.

Every Redis backend calls the script through :func:`script_args` and :func:`parse_reply` only
(:func:`with_token` adds a request token); :data:`SCRIPT_SOURCE` is built once, deterministically.
The wire format: docs/design-notes.md, "The script's wire contract".
"""

from __future__ import annotations

import functools
from binascii import crc_hqx
from collections.abc import Sequence
from itertools import count
from typing import Final

from flask_distlimit.core.algorithms import Algorithm
from flask_distlimit.core.decision import NEVER, Check, Decision, Evaluation
from flask_distlimit.engine.common import US
from flask_distlimit.engine.lua_source import script_parts, script_source
from flask_distlimit.engine.registry import REGISTRY
from flask_distlimit.errors import StorageResponseError

#: The number each algorithm is sent as (``ARGV``): its registry entry's code, which is also
#: its place in the driver's table of loaders (written from these codes).
ALGORITHM_CODES: Final[dict[Algorithm, int]] = {name: e.code for name, e in REGISTRY.items()}

#: Added to the algorithm code of a shadow check: decided and counted, never denies.
SHADOW_FLAG: Final = 16
#: Added to the algorithm code of a release: give back what the check took (a slot, or its
#: cost), then peek.
RELEASE_FLAG: Final = 32
#: Added to the algorithm code of a debt: charge the cost past the limit if need be, then peek.
DEBT_FLAG: Final = 64
#: Added to the algorithm code of a meta limit's check (:attr:`Check.meta
#: <flask_distlimit.core.decision.Check.meta>`): three digits, so never on the fast paths.
META_FLAG: Final = 128

#: The script's parts as built (the benchmarks take them apart).
_PARTS: Final = script_parts(ALGORITHM_CODES, SHADOW_FLAG)
#: The whole script: the helpers' constants, the fast path, the algorithms, then the driver.
SCRIPT_SOURCE: Final[str] = script_source(_PARTS)

_FIELDS: Final = 6
#: The only bytes of a well-formed reply: decimal integers separated by commas.
_INTEGER_BYTES: Final = b"0123456789-,"


def script_args(
    checks: Sequence[Check], now_us: int | None = None, *, refund: bool = False
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV for one script call over ``checks``.

    ``now_us`` injects the time (tests only); ``None`` makes the script use Redis ``TIME``.
    ``refund=True`` undoes a previous consumption of the same checks (Redis Cluster: when a group
    in another slot denied, the groups that consumed give their units back).
    """
    keys: list[str] = []
    fields = [f"{-1 if now_us is None else now_us},{1 if refund else 0}"]
    for check in checks:  # four fields each: algorithm code, limit, period (us), units
        code = ALGORITHM_CODES[check.algorithm] + (SHADOW_FLAG if check.shadow else 0)
        units = check.cost
        if check.token:  # a concurrency slot: its token is sent instead of the cost of 1
            units = check.token if units else 0
        if check.release:  # a slot's, or a rate limit's units given back (request.deduction)
            code += RELEASE_FLAG
        elif check.debt:  # units charged past the limit (request.deduction)
            code += DEBT_FLAG
        elif check.meta:
            code += META_FLAG
        keys.append(check.key)
        fields.append(f"{code},{check.limit},{check.period * US},{units}")
    return keys, [",".join(fields)]


def token_key(first_key: str, token: str) -> str:
    """The key a call's reply is kept under, in ``first_key``'s Cluster slot:
    ``<prefix>:rq:{<tag>}:<token>`` for ``<prefix>:{<tag>}:...`` (under the prefix, so ACL key
    patterns allow it; outside the client's own keys, which inspect and reset list).

    A key without a hash tag (none, ``{}``, a ``{`` without ``}``) is hashed whole by Redis:
    its token is ``<key up to its first "{">:rq:{<key>}:<token>``, the whole key as the tag, or,
    for a key that holds a ``}`` (or is empty) and so cannot be a tag, a short text hashed to the
    same slot (its UTF-8 bytes, as :func:`~flask_distlimit.storage.slot_keys.slot_of`
    hashes)."""
    start = first_key.find("{")
    end = first_key.find("}", start + 1) if start >= 0 else -1
    if end > start + 1:  # Redis hashes what is between the first "{" and the "}" after it
        return f"{first_key[:start]}rq:{first_key[start : end + 1]}:{token}"
    head = first_key if start < 0 else first_key[:start]  # no "{" in it: the tag's is first
    tag = first_key
    if not first_key or "}" in first_key:  # not a tag: a text hashed to its slot
        tag = _slot_tag(crc_hqx(first_key.encode("utf-8", "surrogatepass"), 0) % _SLOTS)
    return f"{head}:rq:{{{tag}}}:{token}"


_SLOTS: Final = 16384


@functools.cache
def _slot_tag(slot: int) -> str:
    """A decimal text that Redis Cluster hashes (crc16) to ``slot``: some 16,000 tries on
    average, once per slot."""
    return next(t for n in count() if crc_hqx((t := str(n)).encode(), 0) % _SLOTS == slot)


def with_token(
    keys: list[str], args: list[str | int], key: str, ttl_ms: int, *, again: bool = False
) -> tuple[list[str], list[str | int]]:
    """``keys`` and ``args`` of one call (:func:`script_args`) carrying a request token whose
    key is ``key`` (:func:`token_key`): the reply is kept ``ttl_ms`` there; ``again``: this is
    the call made once more after its reply was lost (answer the kept reply if it ran)."""
    return [*keys, key], [*args, f"{ttl_ms},1" if again else str(ttl_ms)]


def parse_reply(reply: object, checks: Sequence[Check]) -> Evaluation:
    """Turn the script's reply into an :class:`Evaluation`.

    Raises :class:`~flask_distlimit.errors.StorageResponseError` for a reply of the wrong shape.
    """
    expected = 1 + _FIELDS * len(checks)
    raw = reply.encode("ascii", "replace") if isinstance(reply, str) else reply  # decode_responses
    values: list[int] = []
    # Only digits, commas and minus signs; int() then refuses empty fields and stray signs.
    if type(raw) is bytes and not raw.translate(None, _INTEGER_BYTES):
        try:
            values = list(map(int, raw.split(b",")))
        except ValueError:  # an empty field or a stray sign
            values = []
    if len(values) != expected:
        raise _wrong_reply(reply, expected)
    decisions = []
    repaired: list[str] = []
    fields = iter(values)
    next(fields)  # now_us
    # Six fields per check, in order (zip draws from the same iterator six times per check);
    # allowed 2: a shadow check that would deny; retry -1: never. A time too large for a float
    # (hundreds of digits) raises OverflowError: not our script.
    try:
        for check, allowed, limit, remaining, reset_us, retry_us, bad in zip(
            checks, fields, fields, fields, fields, fields, fields, strict=True
        ):
            decisions.append(
                Decision(
                    allowed != 0,
                    limit,
                    remaining,
                    reset_us / US,
                    NEVER if retry_us < 0 else retry_us / US,
                    allowed == 2,
                )
            )
            if bad:
                repaired.append(check.key)
    except OverflowError:
        raise _wrong_reply(reply, expected) from None
    return Evaluation(tuple(decisions), tuple(repaired), values[0])


def _wrong_reply(reply: object, expected: int) -> StorageResponseError:
    return StorageResponseError(
        f"The rate-limit script answered {reply!r:.200}, not {expected} comma-separated "
        "integers: the script in Redis does not match this version of Flask-DistLimit. "
        "Run SCRIPT FLUSH on the Redis server (it is reloaded on the next request)."
    )
