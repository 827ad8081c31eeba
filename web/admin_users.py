"""The admin API for users, their API keys and the named admin tokens (``residency.users``).

Same rules as the rest of ``/admin``: an admin key or token on every call, a body with any bad
field changes nothing (400 naming each one), every change audited under the admin's name. A
key's and a token's secret is in the answer that creates it, and nowhere else ever.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, request

from residency import errors, users
from residency.errors import ApiError
from web import admin_api
from web.body import read_json
from web.responses import error_response
from web.state import state

bp = Blueprint("admin_users", __name__, url_prefix="/admin")
bp.before_request(admin_api._auth)


def _invalid(e: users.Invalid, what: str) -> ApiError:
    first = next(iter(e.problems))
    message = f"invalid {what}: " + "; ".join(f"{k}: {v}" for k, v in e.problems.items())
    return errors.bad_request(message, None if first == "(body)" else first, f"invalid_{what}")


def _invalid_response(e: users.Invalid, what: str) -> Response:
    return error_response(_invalid(e, what), {"problems": e.problems})


def _not_found(what: str, name: str, param: str = "name") -> ApiError:
    return ApiError(404, f"no {what} '{name}'", param=param, code=f"{what}_not_found")


def _exists(what: str, name: str) -> ApiError:
    return ApiError(
        409, f"{what} '{name}' exists", type="conflict_error", param="name", code=f"{what}_exists"
    )


def _created(body: dict[str, Any]) -> Response:
    resp = jsonify(body)
    resp.status_code = 201
    return resp


# --- users ------------------------------------------------------------------------------------


@bp.post("/users")
def add_user() -> Any:
    try:
        user = users.parse_new_user(read_json())
    except users.Invalid as e:
        return _invalid_response(e, "user")
    try:
        users.add_user(state().r, user, admin_api._actor())
    except users.Exists:
        raise _exists("user", user.name) from None
    return _created({"user": user.public()})


@bp.get("/users")
def list_users() -> Any:
    return jsonify({"users": [u.public() for u in users.all_users(state().r)]})


@bp.get("/users/<name>")
def get_user(name: str) -> Any:
    st = state()
    user = users.get_user(st.r, name)
    if user is None:
        raise _not_found("user", name)
    return jsonify({**user.public(), "keys": [k.public() for k in users.all_keys(st.r, name)]})


@bp.patch("/users/<name>")
def patch_user(name: str) -> Any:
    body = read_json()
    try:
        user = users.update_user(
            state().r, name, lambda u: users.parse_user_patch(u, body), admin_api._actor()
        )
    except users.Invalid as e:
        return _invalid_response(e, "user")
    except users.Missing:
        raise _not_found("user", name) from None
    return jsonify({"user": user.public()})


@bp.delete("/users/<name>")
def delete_user(name: str) -> Any:
    try:
        revoked = users.remove_user(state().r, name, admin_api._actor())
    except users.Missing:
        raise _not_found("user", name) from None
    return jsonify({"deleted": name, "revoked_keys": revoked})


# --- keys -------------------------------------------------------------------------------------


@bp.post("/users/<name>/keys")
def issue_key(name: str) -> Any:
    body = read_json()
    try:
        key, raw = users.parse_new_key(name, body)
    except users.Invalid as e:
        return _invalid_response(e, "key")
    try:
        users.issue_key(state().r, key, admin_api._actor())
    except users.Missing:
        raise _not_found("user", name) from None
    # The only time the key is shown: it is stored hashed.
    return _created({"key": raw, "api_key": key.public()})


@bp.get("/keys")
def list_keys() -> Any:
    user = request.args.get("user") or None
    return jsonify({"keys": [k.public() for k in users.all_keys(state().r, user)]})


@bp.get("/keys/<key_id>")
def get_key(key_id: str) -> Any:
    key = users.get_key(state().r, key_id)
    if key is None:
        raise _not_found("key", key_id, "id")
    return jsonify(key.public())


@bp.delete("/keys/<key_id>")
def revoke_key(key_id: str) -> Any:
    try:
        key = users.revoke_key(state().r, key_id, admin_api._actor())
    except users.Missing:
        raise _not_found("key", key_id, "id") from None
    return jsonify({"revoked": key_id, "user": key.user})


# --- admin tokens -----------------------------------------------------------------------------


@bp.post("/tokens")
def add_token() -> Any:
    body = read_json()
    try:
        extra = [k for k in body if k != "name"]
        if extra:
            raise users.Invalid({k: "unknown field" for k in extra})
        token, raw = users.new_token(users.check_name(body.get("name")))
    except users.Invalid as e:
        return _invalid_response(e, "token")
    try:
        users.add_token(state().r, token, admin_api._actor())
    except users.Exists:
        raise _exists("token", token.name) from None
    return _created({"token": raw, **token.public()})


@bp.get("/tokens")
def list_tokens() -> Any:
    stored = [{**t.public(), "builtin": False} for t in users.all_tokens(state().r)]
    builtin = {"name": users.DEFAULT_TOKEN, "created": None, "builtin": True}
    return jsonify({"tokens": [builtin, *stored]})


@bp.delete("/tokens/<name>")
def delete_token(name: str) -> Any:
    if name == users.DEFAULT_TOKEN:
        raise ApiError(
            409,
            "the token 'default' is the box's admin key (RESIDENCY_ADMIN_KEY or admin.key); "
            "change it there",
            type="conflict_error",
            param="name",
            code="builtin_token",
        )
    try:
        users.remove_token(state().r, name, admin_api._actor())
    except users.Missing:
        raise _not_found("token", name) from None
    return jsonify({"deleted": name})
