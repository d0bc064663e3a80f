"""Client addresses: ``REMOTE_ADDR``, or the ``X-Forwarded-For`` entry trusted proxies vouch for.

The client is the ``X-Forwarded-For`` entry that ``DISTLIMIT_TRUSTED_PROXIES`` hops vouch for,
exactly as werkzeug's ``ProxyFix(x_for=DISTLIMIT_TRUSTED_PROXIES)`` picks it. IPv6 clients are
grouped by their ``/DISTLIMIT_IPV6_PREFIX`` network so one host cannot rotate through its
addresses; an IPv4-mapped IPv6 address counts as its IPv4 address; an unreadable address shares
the bucket ``ip:invalid``.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections.abc import Callable, Mapping
from typing import Final

from werkzeug.http import parse_list_header

__all__ = ["INVALID_IP", "ClientAddresses"]

logger = logging.getLogger(__name__)

#: The one bucket shared by every request whose client address cannot be read.
INVALID_IP: Final = "ip:invalid"

#: Longest client address text parsed (an IPv6 address with zone and port is far shorter).
_MAX_ADDRESS_LENGTH: Final = 128


class ClientAddresses:
    """The client address of a request, as ``"ip:<address>"`` (IPv6 as its network)."""

    def __init__(self, trusted_proxies: int, ipv6_prefix: int) -> None:
        self._trusted = trusted_proxies
        self._shift = 128 - ipv6_prefix
        self._prefix = ipv6_prefix
        self._address: Callable[[str], str] = functools.lru_cache(maxsize=4096)(self._normalize)
        self._warned_invalid = False

    def client_ip(self, environ: Mapping[str, object]) -> str:
        """``"ip:<address>"`` of the client, as ``ProxyFix(x_for=DISTLIMIT_TRUSTED_PROXIES)``
        would set ``REMOTE_ADDR``; IPv6 as its ``/DISTLIMIT_IPV6_PREFIX`` network."""
        address = environ.get("REMOTE_ADDR")
        if self._trusted:
            forwarded = environ.get("HTTP_X_FORWARDED_FOR")
            if forwarded and isinstance(forwarded, str):
                values = parse_list_header(forwarded)
                if len(values) >= self._trusted:
                    chosen = values[-self._trusted]
                    if chosen:
                        address = chosen
        if not isinstance(address, str):
            return self._invalid(address)
        value = self._address(address)
        if value == INVALID_IP:
            return self._invalid(address)
        return value

    def _invalid(self, address: object) -> str:
        if not self._warned_invalid:
            self._warned_invalid = True
            logger.warning(
                "Cannot read the client address %s; such requests share the bucket %r. Behind a "
                "proxy, set DISTLIMIT_TRUSTED_PROXIES. (Logged once.)",
                repr(address)[:80], INVALID_IP,
            )  # fmt: skip
        return INVALID_IP

    def _normalize(self, address: str) -> str:
        text = address.strip()
        if not text or len(text) > _MAX_ADDRESS_LENGTH:
            return INVALID_IP
        if text.startswith("["):  # "[v6]" or "[v6]:port"
            host, bracket, port = text[1:].partition("]")
            if not bracket or (port and not (port[0] == ":" and _is_port(port[1:]))):
                return INVALID_IP
            text = host
        elif text.count(":") == 1:  # "v4:port"
            host, _, port = text.partition(":")
            if not _is_port(port):
                return INVALID_IP
            text = host
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            return INVALID_IP
        if isinstance(ip, ipaddress.IPv6Address):
            mapped = ip.ipv4_mapped
            if mapped is not None:
                return f"ip:{mapped}"
            network = ipaddress.IPv6Network((int(ip) >> self._shift << self._shift, self._prefix))
            return f"ip:{network}"
        return f"ip:{ip}"


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5
