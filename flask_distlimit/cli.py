"""``flask distlimit``: the operator's commands ``status``, ``limits``, ``inspect`` and ``reset``
(docs/cli.md shows each).

``inspect`` peeks with cost 0 in one storage call; ``reset`` finds a client's keys with ``SCAN``,
never ``KEYS``. The commands talk to the storage directly, not through the circuit breaker; a
storage failure is one ``error: ...`` line and exit status 1, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import click
from flask import current_app
from flask.cli import AppGroup

from flask_distlimit.cli_limits import endpoint_of, limit_rows
from flask_distlimit.core.decision import Check, Decision
from flask_distlimit.errors import StorageError
from flask_distlimit.extension import Limiter
from flask_distlimit.identity.addresses import INVALID_IP
from flask_distlimit.ops.admin import NamedCheck, check_kind, delete_counts, identity_keys
from flask_distlimit.resilience.holdings import Holding, holdings
from flask_distlimit.state import LimiterState
from flask_distlimit.storage.urls import mask_url

distlimit_cli = AppGroup(
    "distlimit",
    help="Inspect and reset Flask-DistLimit rate limits (status, limits, inspect, reset).",
)
_Command = TypeVar("_Command", bound=Callable[..., None])


def _command(name: str) -> Callable[[_Command], click.Command]:
    """``distlimit_cli.command(name)``, typed: Flask 2.2 leaves ``AppGroup.command`` unannotated."""
    return cast(Callable[[_Command], click.Command], distlimit_cli.command(name))


def _state() -> LimiterState:
    try:
        return Limiter.state(current_app)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


@contextlib.contextmanager
def _storage_answers() -> Iterator[None]:
    """A storage failure inside is one ``error: The storage did not answer: ...`` line."""
    try:
        yield
    except StorageError as exc:
        raise click.ClickException(f"The storage did not answer: {exc}") from None


def _seconds(value: float) -> str:
    if value == float("inf"):
        return "never"
    if value <= 0:
        return "now"
    return f"{value:.1f} s" if value < 120 else f"{value / 60:.1f} min"


def _identity(state: LimiterState, identity: str, *, ip: bool, api_key: bool) -> str:
    with _storage_answers():
        state.tags.require()  # the storage-kept digest key, when the app sets no secret
    if ip and api_key:
        raise click.UsageError("Use either --ip or --api-key, not both.")
    # an address, as the limiter counts it: IPv6 by network, no port, IPv4 mapped
    if ip or identity.startswith("ip:"):
        found = state.resolver.client_ip({"REMOTE_ADDR": identity.removeprefix("ip:")})
        if found != INVALID_IP:  # else a stored form (ip:2001:db8::/64, ip:invalid-via:...)
            return found
        if ip:
            raise click.UsageError(f"--ip {identity!r} is no address: e.g. --ip 203.0.113.9.")
    if api_key:
        return state.resolver.api_key_identity(identity)
    if not identity.strip():
        raise click.UsageError("IDENTITY is empty: give e.g. ip:203.0.113.9 or user:42.")
    try:
        check_kind(identity)
    except ValueError as exc:
        advice = "Or give an address with --ip or an API key with --api-key."
        raise click.UsageError(f"{exc} {advice}") from None
    return identity


def _identity_options(func: click.decorators.FC) -> click.decorators.FC:
    func = click.option(
        "--api-key",
        is_flag=True,
        help=(
            "IDENTITY is an API key's canonical id (the id your api_key_verifier answers; the "
            "key itself when it answers only a tier): digest it as the limiter does."
        ),
    )(func)
    func = click.option(
        "--ip",
        is_flag=True,
        help="IDENTITY is a client address: normalize it as the limiter does (IPv6 by /64).",
    )(func)
    return click.argument("identity")(func)


def _latency_text(latency: object, error_type: object) -> str:
    if latency is not None:
        return f"{latency} ms (PING round trip)"
    if error_type == "StorageUnavailable":
        return "unreachable"
    if error_type == "StorageMisconfigured":
        return "refused (misconfigured)"
    return "no answer"


#: The "scripts loaded" line, by health()'s ``scripts_loaded`` (``None``: could not tell).
_LOADED_TEXT: dict[object, str] = {True: "yes", False: "no (sent again on first use)"}

# -- status ------------------------------------------------------------------------------------


@_command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the health report as JSON.")
def status(as_json: bool) -> None:
    """Storage, latency, breaker and scripts.

    Shows whether limiting is enabled (DISTLIMIT_ENABLED), the storage URL (password masked),
    a PING round trip, whether the rate-limit scripts are loaded, the circuit breaker and the
    failure settings, after a check that costs nothing
    (a PING and an evaluation of cost 0). Exits with status 1 when the storage does not answer,
    refuses the limiter (misconfigured) or fails otherwise, with the cause on one line
    ("error: ..."), or when the breaker is not closed.
    """
    state = _state()
    settings = state.settings
    health = state.health()
    report = {
        "enabled": settings.enabled,
        "storage_url": mask_url(settings.storage_url),
        "key_prefix": settings.key_prefix,
        "algorithm": settings.algorithm,
        **health,
    }
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        lines = [
            ("enabled", "yes" if settings.enabled else "no (DISTLIMIT_ENABLED is False)"),
            ("storage", f"{report['storage_url']} ({health.get('storage')})"),
            ("latency", _latency_text(health.get("latency_ms"), health.get("error_type"))),
            ("error", health.get("error")),
            ("scripts loaded", _LOADED_TEXT.get(health.get("scripts_loaded"), "unknown")),
            ("breaker", _breaker_text(health)),
            ("failure policy", health.get("policy")),
            (
                "instances",
                f"{health.get('instances')} (seen: {health.get('instances_seen')}, "
                f"fallback divisor: {health.get('fallback_divisor')})",
            ),
            ("key prefix", settings.key_prefix),
            ("default algorithm", settings.algorithm),
        ]
        for label, value in lines:
            if value is not None:
                click.echo(f"{label + ':':<19}{value}")
    if not health.get("ok"):
        raise click.exceptions.Exit(1)


def _breaker_text(health: dict[str, object]) -> str:
    """The breaker line: with one node, its state and failures; with several (a Redis
    Cluster), the worst state and every node whose breaker is not closed, by name, among the
    nodes this process has called (a breaker is made on a node's first call; each node's count
    is in ``--json``'s ``breaker_nodes``)."""
    worst = health.get("breaker")
    states = health.get("breakers")
    if not isinstance(states, dict) or len(states) <= 1:
        return f"{worst} ({health.get('breaker_failures')} consecutive failures)"
    not_closed = [f"{node} {state}" for node, state in sorted(states.items()) if state != "closed"]
    if not not_closed:
        return f"{worst} (all {len(states)} nodes called)"
    closed = len(states) - len(not_closed)
    return f"{worst} ({', '.join(not_closed)}; {closed} of {len(states)} nodes called closed)"


# -- inspect -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Row:
    name: str
    check: Check
    decision: Decision
    stored: bool
    #: a leased limit: the most units each serving process may hold of it (counted as used)
    lease: int | None = None
    #: a leased limit: what each serving process published that it holds of this key
    held: Sequence[Holding] = ()

    def as_dict(self) -> dict[str, object]:
        d = self.decision
        return {
            "limit": self.name,
            "algorithm": self.check.algorithm,
            "quota": d.limit,
            "period": self.check.period,
            "used": d.limit - d.remaining,
            "remaining": d.remaining,
            "reset_after": d.reset_after,
            "stored": self.stored,
            "key": self.check.key,
            "lease_per_process": self.lease,
            "leases_held": None if self.lease is None else [h._asdict() for h in self.held],
        }


def _peek(state: LimiterState, identity: str) -> list[_Row]:
    named = state.checks_for(identity, cost=0)
    if not named:
        return []
    checks = [row.check for row in named]
    sizes = [state.lease_size(check.key) for check in checks]
    held: dict[str, list[Holding]] = {}
    with _storage_answers():
        stored = set(identity_keys(state, identity))
        evaluation = state.storage.evaluate(checks)
        if any(size is not None for size in sizes):  # what the serving processes published
            held = holdings(state.storage.lease_records(state.lease_records_key()))
    return [
        _Row(row.name, row.check, d, row.check.key in stored, size, held.get(row.check.key, ()))
        for row, d, size in zip(named, evaluation.decisions, sizes, strict=True)
    ]


@_command("inspect")
@_identity_options
@click.option("--all", "show_all", is_flag=True, help="Also list limits the client has not used.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def inspect(identity: str, ip: bool, api_key: bool, show_all: bool, as_json: bool) -> None:
    """One client's usage of every limit (a peek).

    Where IDENTITY stands on every limit that can apply to it (global, tiers, routes), read in
    one storage call with cost 0: nothing is consumed.
    """
    state = _state()
    who = _identity(state, identity, ip=ip, api_key=api_key)
    rows = [r for r in _peek(state, who) if show_all or r.stored]
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    if not rows:
        click.echo(f"{who}: no counters stored (every limit is whole).")
        if not show_all:
            click.echo("Use --all to list the limits that would apply.")
        return
    click.echo(f"{who}:")
    width = max(len(r.name) for r in rows)
    click.echo(f"  {'limit':<{width}}  {'algorithm':<22}  {'used':>12}  {'remaining':>9}  whole in")
    for r in rows:
        d = r.decision
        used = f"{d.limit - d.remaining}/{d.limit}"
        click.echo(
            f"  {r.name:<{width}}  {r.check.algorithm:<22}  {used:>12}  {d.remaining:>9}  "
            f"{_seconds(d.reset_after)}"
            + (f"  (leased: up to {r.lease} per process)" if r.lease is not None else "")
        )
        if r.lease is not None:
            for h in r.held:
                units = f"{h.units} unit{'' if h.units == 1 else 's'}"
                click.echo(
                    f"  {'':<{width}}    held by {h.process}: {units}, good for "
                    f"{_seconds(h.valid_for)} (published {h.published_ago:.1f} s ago)"
                )
            if not r.held:
                click.echo(f"  {'':<{width}}    held by no process (none published a lease)")
    if any(r.lease is not None for r in rows):
        click.echo(
            "Leased limits: units the serving processes hold count as used here; each process "
            "publishes what it holds when it renews a lease, at most once a second, so a "
            "process's figure may be up to that old (its own health()['leases'] is current)."
        )


# -- reset ---------------------------------------------------------------------------------------


def _select(rows: Sequence[NamedCheck], wanted: Sequence[str]) -> set[str]:
    names = sorted({row.name for row in rows})
    keys: set[str] = set()
    for want in wanted:
        matched = [row.check.key for row in rows if want in (row.name, row.name.split(":", 1)[0])]
        if not matched:
            raise click.BadParameter(
                f"No limit named {want!r} applies to this identity. Names: {', '.join(names)}.",
                param_hint="--limit",
            )
        keys.update(matched)
    return keys


@_command("reset")
@_identity_options
@click.option(
    "--limit",
    "limits",
    multiple=True,
    metavar="NAME",
    help="Reset only this limit (e.g. tier-pro or tier-pro:1800/minute); repeatable.",
)
@click.option("--dry-run", is_flag=True, help="List the keys that would be deleted.")
def reset(identity: str, ip: bool, api_key: bool, limits: tuple[str, ...], dry_run: bool) -> None:
    """Forget one client's counters (uses SCAN).

    Deletes IDENTITY's counters: every limit, or only those named with --limit. Keys are found
    with SCAN, never KEYS. Workers that already refused the client keep refusing
    it locally until the Retry-After they sent has passed (their deny cache).
    """
    state = _state()
    who = _identity(state, identity, ip=ip, api_key=api_key)
    with _storage_answers():
        stored = set(identity_keys(state, who))
    if limits:
        stored &= _select(state.checks_for(who, cost=0), limits)
    if dry_run:
        for key in sorted(stored):
            click.echo(key)
        click.echo(f"{len(stored)} key(s) would be deleted for {who}.")
        return
    with _storage_answers():
        deleted = delete_counts(state, sorted(stored))
    click.echo(f"Deleted {deleted} key(s) of {who}.")


# -- limits ------------------------------------------------------------------------------------


@_command("limits")
@click.option("--endpoint", default=None, help="Only this endpoint (e.g. api.items).")
@click.option("--path", default=None, help="Only the endpoint this path reaches (e.g. /orders/7).")
@click.option("--method", default=None, help="Only this HTTP method (with --path: matched).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def limits(endpoint: str | None, path: str | None, method: str | None, as_json: bool) -> None:
    """Every endpoint with its limits (like 'flask routes').

    Lists, from the app's own declarations, the limits of every request (global, tier) and of
    every endpoint and method: limit name and value, kind (route, shared, blueprint or default
    limits show as route), algorithm, who is counted, the failure policy, and options
    (callable or per-tier values, deduct_when, cost, exempt_when). Exempt endpoints say so.
    Nothing is read from the storage. --endpoint, --path and --method narrow the endpoints and
    methods listed; the global and tier limits, which apply to every request, stay.
    """
    state = _state()
    method = method.upper() if method else None
    rows = limit_rows(state, endpoint_of(endpoint, path, method), method)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    columns = ["endpoint", "methods", "rule", "limit", "algorithm", "key", "on_failure", "notes"]
    titles = ["Endpoint", "Methods", "Rule", "Limit", "Algorithm", "Counted by", "On failure", ""]
    table = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(t), *(len(line[i]) for line in table)]) for i, t in enumerate(titles)]
    rules = [*("-" * w for w in widths[:-1]), ""]  # under every title but the notes'
    for line in (titles, rules, *table):
        click.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
