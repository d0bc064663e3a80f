"""Client addresses: ``REMOTE_ADDR``, or the ``X-Forwarded-For`` entry trusted proxies vouch for.

The client is the entry ``DISTLIMIT_TRUSTED_PROXIES`` hops from the right, read as the proxies
wrote it (split on commas, never parsed); ``Forwarded`` is never read. An entry that is no
address counts as ``ip:invalid-via:<nearest trusted hop>``; IPv6 clients count by their
``/DISTLIMIT_IPV6_PREFIX`` network, IPv4-mapped and NAT64 (``64:ff9b::/96``) ones as IPv4
(docs/identity.md, "Trusted proxies").
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections.abc import Callable, Mapping
from typing import Final

logger = logging.getLogger(__name__)

#: The one bucket shared by every request whose client address cannot be read.
INVALID_IP: Final = "ip:invalid"
#: The head of ``ip:invalid-via:<address>``: requests whose forwarded client entry is not an IP
#: address, counted per nearest trusted hop, apart from every real client.
UNIDENTIFIED_VIA: Final = "ip:invalid-via:"

#: The well-known NAT64 prefix ``64:ff9b::/96``, shifted down by its 32 bits of IPv4 address.
_NAT64: Final = 0x64FF9B << 64
#: Longest client address text parsed (an IPv6 address with zone and port is far shorter).
_MAX_ADDRESS_LENGTH: Final = 128


class ClientAddresses:
    """The client address of a request, as ``"ip:<address>"`` (IPv6 as its network)."""

    def __init__(self, trusted_proxies: int, ipv6_prefix: int) -> None:
        self._trusted = trusted_proxies
        self._prefix = ipv6_prefix
        self._address: Callable[[str], str] = functools.lru_cache(maxsize=4096)(self._normalize)
        self._warned_invalid = False
        self._warned_unidentified = False

    def client_ip(self, environ: Mapping[str, object]) -> str:
        """``"ip:<address>"`` of the client (IPv6 as its ``/DISTLIMIT_IPV6_PREFIX`` network), or
        ``"ip:invalid-via:<address>"`` when the forwarded client entry is not an address."""
        remote = environ.get("REMOTE_ADDR")
        trusted = self._trusted
        if trusted:
            forwarded = environ.get("HTTP_X_FORWARDED_FOR")
            if isinstance(forwarded, str):  # present, even empty: the proxies wrote it
                # At most trusted + 1 parts: the last `trusted` entries exactly as the proxies
                # wrote them, and before them whatever the client sent (never parsed).
                parts = forwarded.rsplit(",", trusted)
                if len(parts) >= trusted:
                    chosen = self._address(parts[-trusted])
                    if chosen != INVALID_IP:
                        return chosen
                # No address where the client's should be: count it at the nearest trusted hop.
                return self._unidentified(parts[max(0, len(parts) - trusted + 1) :], remote)
        value = self._address(remote) if isinstance(remote, str) else INVALID_IP
        return value if value != INVALID_IP else self._invalid(remote)

    def _unidentified(self, hops: list[str], remote: object) -> str:
        """``ip:invalid-via:<address>`` of the first readable trusted hop, nearest to the
        client first (``hops``, then ``REMOTE_ADDR``)."""
        for hop in (*hops, remote):
            value = self._address(hop) if isinstance(hop, str) else INVALID_IP
            if value != INVALID_IP:
                marked = UNIDENTIFIED_VIA + value[3:]
                if not self._warned_unidentified:
                    self._warned_unidentified = True
                    logger.warning(
                        "X-Forwarded-For holds no client address %d hop(s) from the right; "
                        "such requests are counted as %r, apart from every client. A client "
                        "that sends junk does this; if every request does, "
                        "DISTLIMIT_TRUSTED_PROXIES (%d) is more than the proxies that append "
                        "to X-Forwarded-For. (Logged once.)",
                        self._trusted, marked, self._trusted,
                    )  # fmt: skip
                return marked
        return self._invalid(remote)

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
        text = address.strip(" \t")  # as a proxy may pad an entry, nothing else
        if not text or len(text) > _MAX_ADDRESS_LENGTH:
            return INVALID_IP
        if text.startswith("["):  # "[v6]" or "[v6]:port"
            text, bracket, port = text[1:].partition("]")
            if not bracket or (port and not (port[0] == ":" and _is_port(port[1:]))):
                return INVALID_IP
        elif text.count(":") == 1:  # "v4:port"
            text, _, port = text.partition(":")
            if not _is_port(port):
                return INVALID_IP
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            return INVALID_IP
        if isinstance(ip, ipaddress.IPv6Address):  # IPv4-mapped: that IPv4 client; else its network
            mapped = ip.ipv4_mapped
            if int(ip) >> 32 == _NAT64:  # 64:ff9b::/96 (RFC 6052): an IPv4 client translated
                mapped = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
            return f"ip:{mapped or ipaddress.IPv6Network((int(ip), self._prefix), strict=False)}"
        return f"ip:{ip}"


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5 and int(text) <= 65535
