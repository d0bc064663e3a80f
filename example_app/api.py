"""The example API: a public catalogue, authenticated orders, a login with a strict per-account
limit that fails closed, an exempt health check, and the downstream counter.

- ``GET /catalogue``, ``GET /catalogue/<id>``: anyone; the caller's tier limit;
- ``GET /orders``, ``POST /orders``: a verified JWT or API key; the tier, and POST also
  10/minute (token bucket);
- ``POST /token``: anyone; 5/minute per account, failing closed when Redis is down;
- ``GET /downstream``: exempt; how often the handlers above really ran;
- ``GET /health``: exempt.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from flask import Blueprint, abort, current_app, jsonify, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from flask_distlimit import Limiter

from . import auth
from .downstream import Downstream

__all__ = ["bp", "limiter"]

#: The app's one limiter; ``create_app`` calls ``limiter.init_app(app)``.
limiter = Limiter()

bp = Blueprint("api", __name__)

CATALOGUE: list[dict[str, Any]] = [
    {"id": 1, "name": "Espresso beans, 1 kg", "price": "21.50"},
    {"id": 2, "name": "Burr grinder", "price": "149.00"},
    {"id": 3, "name": "Milk jug, 350 ml", "price": "12.90"},
]

_orders: dict[str, list[dict[str, Any]]] = {}
_orders_lock = threading.Lock()
_order_ids = itertools.count(1000)


def downstream() -> Downstream:
    counter: Downstream = current_app.extensions["example_downstream"]
    return counter


@limiter.api_key_verifier
def _api_key_tier(raw_key: str) -> str | None:
    """The limiter counts an API key only when the app's store knows it (else: anonymous)."""
    caller = auth.verify_api_key(raw_key)
    return caller.tier if caller is not None else None


def _account_from_body() -> str:
    """The login's rate-limit key: the account named in the body, whatever the client's address."""
    body = request.get_json(silent=True)
    account = body.get("account") if isinstance(body, dict) else None
    return f"account:{account if isinstance(account, str) else ''}"


def _require_caller() -> auth.Caller:
    caller = auth.authenticate()
    if caller is None:
        abort(401, "Send 'Authorization: Bearer <token>' (POST /token) or 'X-Api-Key: <key>'.")
    return caller


def _caller_name() -> str:
    caller = auth.authenticate()
    return caller.client_id if caller is not None else "anonymous"


@bp.get("/catalogue")
def catalogue() -> ResponseReturnValue:
    downstream().hit("catalogue", _caller_name())
    return jsonify(items=CATALOGUE)


@bp.get("/catalogue/<int:item_id>")
def catalogue_item(item_id: int) -> ResponseReturnValue:
    downstream().hit("catalogue", _caller_name())
    for item in CATALOGUE:
        if item["id"] == item_id:
            return jsonify(item)
    abort(404, f"No catalogue item {item_id}.")


@bp.get("/orders")
def list_orders() -> ResponseReturnValue:
    caller = _require_caller()
    downstream().hit("orders", caller.client_id)
    with _orders_lock:
        mine = list(_orders.get(caller.client_id, []))
    return jsonify(client=caller.client_id, tier=caller.tier, orders=mine)


@bp.post("/orders")
@limiter.limit("10/minute", algorithm="token_bucket")
def create_order() -> ResponseReturnValue:
    caller = _require_caller()
    body = request.get_json(silent=True)
    if not isinstance(body, dict) or not isinstance(body.get("item"), int):
        abort(400, 'Send a JSON body such as {"item": 1, "quantity": 2}.')
    downstream().hit("orders", caller.client_id)
    order = {"id": next(_order_ids), "item": body["item"], "quantity": body.get("quantity", 1)}
    with _orders_lock:
        _orders.setdefault(caller.client_id, []).append(order)
    return jsonify(order), 201


@bp.post("/token")
@limiter.limit("5/minute", key_func=_account_from_body, on_failure="closed")
def token() -> ResponseReturnValue:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        abort(400, 'Send a JSON body such as {"account": "alice", "password": "alice-pw"}.')
    account = auth.verify_password(str(body.get("account", "")), str(body.get("password", "")))
    downstream().hit("token", f"account:{body.get('account', '')}")
    if account is None:
        abort(401, "Unknown account or wrong password.")
    return jsonify(access_token=auth.issue_token(account), token_type="Bearer", tier=account.tier)


@bp.get("/downstream")
@limiter.exempt
def downstream_counts() -> ResponseReturnValue:
    return jsonify(downstream().describe())


@bp.get("/health")
@limiter.exempt
def health() -> ResponseReturnValue:
    return jsonify(status="ok")


@bp.app_errorhandler(HTTPException)
def problem(exc: HTTPException) -> ResponseReturnValue:
    """Every error as RFC 9457 problem+json, like the limiter's own 429 and 503."""
    response = exc.get_response()
    if response.mimetype == "application/problem+json":
        return response  # the limiter's 429/503: already a problem document
    document = {
        "type": "about:blank",
        "title": exc.name,
        "status": exc.code,
        "detail": exc.description,
    }
    response.set_data(current_app.json.dumps(document))
    response.mimetype = "application/problem+json"
    return response
