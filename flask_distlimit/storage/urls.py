"""Storage URLs (``DISTLIMIT_STORAGE_URL``) -> a :class:`~flask_distlimit.storage.Storage`.

:func:`from_url` accepts :data:`ACCEPTED_FORMS` (``memory://``, ``redis://``, ``rediss://``,
``unix://``, ``redis+sentinel://``, ``redis+cluster://`` and their ``valkey`` twins) with the
query parameters docs/configuration.md lists; anything else, an unknown parameter included, is a
:class:`~flask_distlimit.errors.ConfigurationError` at ``init_app`` that names the URL with its
passwords masked (:func:`mask_url`) and the accepted forms. Timeouts come from ``timeout``, not
the URL. Nothing connects until the first call. Why this is not redis-py's ``from_url``:
docs/deployment.md, "Storage URLs".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

import redis

from flask_distlimit.errors import ConfigurationError
from flask_distlimit.storage.base import Storage
from flask_distlimit.storage.cluster import ClusterStorage
from flask_distlimit.storage.memory import MemoryStorage
from flask_distlimit.storage.redis import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT, RedisStorage
from flask_distlimit.storage.tokens import token_mode

ACCEPTED_FORMS: Final = (
    "memory://",
    "redis://[:password@]host[:port][/db]",
    "rediss://[:password@]host[:port][/db]",
    "unix:///path/to/redis.sock[?db=N]",
    "redis+sentinel://[:password@]host:port[,host:port...]/service[/db]",
    "redis+cluster://[:password@]host:port[,host:port...]",
    "valkey://, valkeys://, valkey+sentinel://, valkey+cluster:// (as the redis ones)",
)

_TRUE: Final = {"1", "true", "yes", "on"}
_FALSE: Final = {"0", "false", "no", "off"}


def _bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


_COMMON_QUERY: Final[dict[str, Callable[[str], Any]]] = {
    "username": str,
    "password": str,
    "client_name": str,
    "max_connections": int,
    "ssl_cert_reqs": str,
    "ssl_ca_certs": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_check_hostname": _bool,
}
#: One endpoint's: a request's checks in one script call per hash slot (RedisStorage's).
_ENDPOINT_QUERY: Final[dict[str, Callable[[str], Any]]] = {
    **_COMMON_QUERY,
    "db": int,
    "split_slots": _bool,
}
_QUERY: Final[dict[str, dict[str, Callable[[str], Any]]]] = {
    **dict.fromkeys(("redis", "rediss", "unix"), _ENDPOINT_QUERY),  # one endpoint each
    "redis+sentinel": {
        **_ENDPOINT_QUERY,
        "ssl": _bool,
        "sentinel_username": str,
        "sentinel_password": str,
    },
    "redis+cluster": {**_COMMON_QUERY, "ssl": _bool},
}
#: Valkey's schemes (as ``limits`` spells them), read as the Redis ones they are twins of:
#: ``valkey`` for ``redis`` in each.
_VALKEY_SCHEMES: Final = {s.replace("redis", "valkey"): s for s in _QUERY if s.startswith("redis")}
#: Every scheme :func:`from_url` reads (``DISTLIMIT_STORAGE_URL`` is checked against them).
SCHEMES: Final = ("memory", *_QUERY, *_VALKEY_SCHEMES)

#: Every query parameter name the URLs accept: a password value ends only where one of them
#: follows (an unencoded ``&`` or ``#`` inside a password is still the password's).
_QUERY_NAMES: Final = "|".join(sorted({n for q in _QUERY.values() for n in q}, key=len)[::-1])
_QUERY_SECRET: Final = re.compile(
    rf"((?:^|[?&])(?:sentinel_)?password=).*?(?=&(?:{_QUERY_NAMES})=|$)", re.DOTALL
)
_QUOTED: Final = re.compile(r"'[^']*'|\"[^\"]*\"")


def mask_url(url: str) -> str:
    """``url`` with every password replaced by ``***`` (for messages and logs).

    A password may hold any character unencoded, ``@ / ? # : %`` included, so the credentials
    run from after ``://`` to the **last** ``@`` of the URL: everything after the first ``:``
    of that part is hidden (when an ``@`` in a query value is taken for it, more is hidden than
    needed, never less). Without an ``@``, an authority that starts with ``:`` (no host, as in
    ``redis://:secret``) is hidden after its ``:``. A ``password=`` or ``sentinel_password=``
    query value is hidden up to the next ``&`` that starts a parameter the URLs accept.
    """
    url = _QUERY_SECRET.sub(r"\1***", url)  # first: a query password may hold an "@"
    scheme, sep, rest = url.partition("://")
    if sep:
        userinfo, at, tail = rest.rpartition("@")
        if at and ":" in userinfo:
            rest = f"{userinfo.partition(':')[0]}:***@{tail}"
        elif not at and rest.startswith(":"):
            end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
            rest = f":***{rest[end:]}"
        url = f"{scheme}://{rest}"
    return url


class _BadURL(ValueError):
    pass


def from_url(
    url: str, *, timeout: float = DEFAULT_TIMEOUT, request_tokens: str = "auto", **options: Any
) -> Storage:
    """The storage a URL names; raises :class:`ConfigurationError` for a bad URL.

    ``timeout`` bounds connecting, reading a reply and waiting for a pooled connection
    (seconds). ``request_tokens``: when a Redis call carries a request token, ``"auto"`` or
    ``"always"`` (``DISTLIMIT_REQUEST_TOKENS``; :mod:`flask_distlimit.storage.tokens`; nothing
    to ``memory://``). ``options`` go to the backend's constructor (e.g. ``max_connections``,
    or redis-py connection keywords).
    """
    token_mode(request_tokens)  # a ConfigurationError when it is none
    if not isinstance(url, str) or not url.strip():
        raise _configuration_error(str(url), "the URL is empty")
    if not (isinstance(timeout, int | float) and 0 < timeout < float("inf")):
        raise ConfigurationError(
            f"Storage timeout must be a positive number of seconds, got {timeout!r} "
            "(DISTLIMIT_REDIS_TIMEOUT, default 0.1)."
        )
    try:
        return _build(url.strip(), float(timeout), request_tokens, options)
    except _BadURL as exc:
        raise _configuration_error(url, str(exc)) from None


def _configuration_error(url: str, reason: str) -> ConfigurationError:
    shown = mask_url(url)
    if shown != url:
        # A password holding an unencoded "/", "?" or "#" is split there by the parser, and
        # ``reason`` may quote a piece of it (a "port", a "query string"): every quoted piece
        # that the masked URL does not show is hidden.
        reason = _QUOTED.sub(lambda m: m[0] if m[0][1:-1] in shown else "'***'", reason)
    return ConfigurationError(
        f"Invalid storage URL {shown!r}: {reason}. Accepted forms: "
        + ", ".join(ACCEPTED_FORMS)
        + "."
    )


def _build(url: str, timeout: float, request_tokens: str, options: dict[str, Any]) -> Storage:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise _BadURL("it has no scheme (such as redis://)")
    scheme = _VALKEY_SCHEMES.get(scheme.lower(), scheme.lower())
    if scheme == "memory":
        if rest.strip("/"):
            raise _BadURL("memory:// takes nothing after the scheme")
        return MemoryStorage(**options)
    if scheme not in _QUERY:
        raise _BadURL(f"unknown scheme {scheme!r}")
    try:
        parts = urlsplit(f"{scheme}://{rest}")
    except ValueError as exc:  # e.g. an unbalanced IPv6 bracket
        raise _BadURL(f"malformed URL ({exc})") from None
    if parts.fragment:
        raise _BadURL("a URL fragment (#...) has no meaning here")
    query = _parse_query(scheme, parts.query)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    credentials = {k: unquote(v) for k, v in (("username", user), ("password", password)) if v}
    # what the backend's constructor is given: the URL's, then the caller's options
    given: dict[str, Any] = {"max_connections": DEFAULT_MAX_CONNECTIONS, **credentials, **query}
    if given["max_connections"] < 1:
        raise _BadURL("max_connections must be at least 1")
    if given.get("db", 0) < 0:
        raise _BadURL("db must be 0 or more")
    if given.get("ssl") is False:
        del given["ssl"]  # ssl=false is as if not given
    tls = scheme == "rediss" or "ssl" in given
    tls_options = sorted(k for k in given if k.startswith("ssl_"))
    if tls_options and not tls:
        raise _BadURL(f"{', '.join(tls_options)} need TLS (rediss://, or ssl=true)")
    given.update(request_tokens=request_tokens, **options)

    if scheme == "unix":
        if hostlist:
            raise _BadURL("unix:// takes a path, e.g. unix:///run/redis/redis.sock")
        if not parts.path or parts.path == "/":
            raise _BadURL("unix:// needs the socket's path")
        socket = {"connection_class": redis.UnixDomainSocketConnection, "scheme": "unix"}
        return RedisStorage(timeout=timeout, **{**given, **socket, "path": unquote(parts.path)})
    hosts = _hosts(hostlist, scheme)
    if scheme in ("redis", "rediss"):
        path = parts.path.strip("/")
        if path:
            given["db"] = _path_db(path, query, "the path must be a database number")
        connection_class = redis.SSLConnection if tls else redis.Connection
        endpoint = {"connection_class": connection_class, "host": hosts[0][0], "port": hosts[0][1]}
        return RedisStorage(timeout=timeout, **{**given, **endpoint, "scheme": scheme})
    if scheme == "redis+sentinel":
        segments = [unquote(s) for s in parts.path.split("/") if s]
        if not segments:
            raise _BadURL("redis+sentinel:// needs the service name as its path (/mymaster)")
        if len(segments) > 2:
            raise _BadURL("the path is /service or /service/db")
        if len(segments) == 2:
            given["db"] = _path_db(segments[1], query, "the path's second part must be a db number")
        sentinel_options = dict(credentials)
        for name in ("username", "password"):
            value = given.pop(f"sentinel_{name}", None)
            if value is not None:
                sentinel_options[name] = value
        return RedisStorage.sentinel(
            hosts, segments[0], timeout=timeout, sentinel_options=sentinel_options, **given
        )
    if parts.path.strip("/"):  # redis+cluster
        raise _BadURL("redis+cluster:// takes no path (a cluster has only database 0)")
    return ClusterStorage(hosts, timeout=timeout, **given)


def _parse_query(scheme: str, query: str) -> dict[str, Any]:
    accepted = _QUERY[scheme]
    parsed: dict[str, Any] = {}
    try:
        pairs = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise _BadURL(f"the query string {query!r} is malformed") from None
    for name, values in pairs.items():
        if name not in accepted:
            raise _BadURL(
                f"unknown query parameter {name!r} for {scheme}:// "
                f"(accepted: {', '.join(sorted(accepted))}; timeouts come from the timeout "
                "setting, DISTLIMIT_REDIS_TIMEOUT)"
            )
        if len(values) != 1:
            raise _BadURL(f"query parameter {name!r} is given more than once")
        try:
            parsed[name] = accepted[name](values[0])
        except ValueError:
            shown = "***" if "password" in name else repr(values[0])
            raise _BadURL(f"query parameter {name!r} has an invalid value {shown}") from None
    return parsed


def _hosts(hostlist: str, scheme: str) -> list[tuple[str, int]]:
    """The hosts of the URL's authority (several only on redis+sentinel and redis+cluster)."""
    if not hostlist:
        raise _BadURL(f"{scheme}:// needs a host")
    entries = hostlist.split(",")
    if not scheme.startswith("redis+") and len(entries) > 1:
        raise _BadURL(f"{scheme}:// takes one host (use redis+sentinel:// or redis+cluster://)")
    hosts = []
    for entry in entries:
        if entry.startswith("["):
            host, bracket, tail = entry[1:].partition("]")
            if not bracket or (tail and not tail.startswith(":")):
                raise _BadURL(f"malformed IPv6 host {entry!r}")
            port_text = tail[1:]
        else:
            host, _, port_text = entry.partition(":")
        if not host:
            raise _BadURL(f"empty host in {hostlist!r}")
        port = 26379 if scheme == "redis+sentinel" else 6379
        if port_text:
            port = _int(port_text, f"port {port_text!r} is not a number")
            if not 0 < port < 65536:
                raise _BadURL(f"port {port} is out of range 1-65535")
        hosts.append((unquote(host), port))
    return hosts


def _path_db(text: str, query: dict[str, Any], reason: str) -> int:
    """The database number the URL's path gives (``reason``: what is wrong when it is none)."""
    if "db" in query:
        raise _BadURL("db is given both in the path and as a query parameter")
    return _int(text, reason)


def _int(text: str, reason: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _BadURL(reason) from None
