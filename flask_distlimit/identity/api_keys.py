"""API keys: the ``DISTLIMIT_API_KEY_HEADER`` header, an identity only when the app's verifier
accepts it (its answers: :data:`VerifierAnswer`; docs/identity.md, "API keys").

A key, or the canonical id the verifier answers, is kept only as an HMAC-SHA256 digest, never in
keys, logs or exceptions; an unknown or over-long key is anonymous. With neither
``DISTLIMIT_API_KEY_SECRET`` nor ``SECRET_KEY``, a digest raises (:data:`NO_SECRET`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from typing import Final, TypeAlias

from flask_distlimit.errors import ConfigurationError

#: What an API key verifier answers: ``None`` (unknown), a tier, or ``(key_id, tier or None)``.
VerifierAnswer: TypeAlias = str | tuple[str | int, str | None] | None
#: ``(raw_key) -> VerifierAnswer``
ApiKeyVerifier: TypeAlias = Callable[[str], VerifierAnswer]

#: Longest API key passed to the verifier; a longer header is ignored as an unknown key.
MAX_API_KEY_LENGTH: Final = 1024

_DIGEST_CONTEXT: Final = b"flask-distlimit api-key"

#: Why a request or tool that needs an API key's digest cannot have one, and the fix.
NO_SECRET: Final = (
    "API keys are digested with a secret, so that they are never stored in clear, and there is "
    "none: set DISTLIMIT_API_KEY_SECRET (or the app's SECRET_KEY) to a long random string, "
    "e.g. secrets.token_hex(32), before init_app."
)


def id_text(value: object) -> str | None:
    """``value`` as the text of an id (a user's, a key's, a token's client): a non-empty str or
    an int, never a bool; ``None`` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        return None
    return str(value)


class ApiKeys:
    """Reads, verifies and digests the API key of a request."""

    __slots__ = ("_mac", "environ_key")

    def __init__(self, header: str, secret: bytes | None) -> None:
        #: the WSGI environ key of the header
        self.environ_key = "HTTP_" + header.upper().replace("-", "_")
        # keyed apart from every other use of the secret (its own context)
        key = None if secret is None else hmac.new(secret, _DIGEST_CONTEXT, hashlib.sha256).digest()
        self._mac = None if key is None else hmac.new(key, digestmod=hashlib.sha256)

    def identity(self, raw_key: str) -> str:
        """``"apikey:<hex>"``: the identity of a (verified) API key, without the key itself."""
        if self._mac is None:
            raise ConfigurationError(NO_SECRET)
        mac = self._mac.copy()
        mac.update(raw_key.encode("utf-8", "surrogatepass"))
        return "apikey:" + mac.hexdigest()

    def verify(
        self, environ: Mapping[str, object], verifier: ApiKeyVerifier
    ) -> tuple[str, object] | None:
        """``(identity text, tier)`` of the request's key when ``verifier`` accepts it: the
        digest of the key's canonical id when the verifier answers one, else of the key."""
        raw = environ.get(self.environ_key)
        if not (isinstance(raw, str) and raw and len(raw) <= MAX_API_KEY_LENGTH):
            return None
        answer: object = verifier(raw)
        if answer is None or answer == "":  # "" is no tier: not a fallback for any key
            return None
        if isinstance(answer, str):
            return self.identity(raw), answer
        if isinstance(answer, tuple) and len(answer) == 2:
            key_id, tier = answer
            key_text = id_text(key_id)
            if key_text is None:
                raise TypeError(
                    "The API key verifier answered (key_id, tier) with a key_id that is "
                    f"{'empty' if key_id == '' else 'a ' + type(key_id).__name__}; the key_id is "
                    "the key's canonical id, a non-empty str or an int (e.g. its id in your "
                    "store)."
                )
            return self.identity(key_text), tier
        raise TypeError(
            f"The API key verifier returned a {type(answer).__name__}; it must return None (an "
            "unknown key), the key's tier, or (key_id, tier or None) with the key's canonical id."
        )
