"""Users, their API keys and the named admin tokens: records, validation and the Redis store.

A key is ``rsk_<id>_<secret>`` and an admin token ``rsa_<name>_<secret>``, each secret 32
random bytes in hex. Only the SHA-256 of a secret is stored (a fast hash is enough for random
secrets: there is nothing to guess from it), and the secret is shown once, when issued. Every
change is one MULTI with its audit record; a change that depends on what is stored (a name that
must be new, a user that must exist) is checked under WATCH, so a key is never issued for a
user removed meanwhile. Web reads a key and its user in one script call (``principal.lua``) on
every request that carries one: a revoke is seen by the next request of every web process.

The admin key of the box (``RESIDENCY_ADMIN_KEY`` or ``admin.key``) is the admin token named
``default``; it is never stored here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import redis

from residency import keys
from residency.auth import Principal, Quotas
from residency.box import audit
from residency.settings import MODEL_NAME_RE

NAME_RE = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
KEY_PREFIX = "rsk_"
TOKEN_PREFIX = "rsa_"
DEFAULT_TOKEN = "default"
_ID_RE = re.compile(r"^[0-9a-f]{16}$")
_SECRET_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_WEIGHT = 1000.0
MAX_QUOTA = 10**12
MAX_LABEL = 200
MAX_SCOPE_NAMES = 1000
#: Names no user may take: each would read as another subject in reports (``-`` is the
#: anonymous callers; a ':' would read as a namespace, and ``NAME_RE`` allows none).
RESERVED_USER_NAMES = frozenset({"-"})

T = TypeVar("T")


class Invalid(ValueError):
    """A request body with bad fields; ``problems`` maps each field to what is wrong."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{k}: {v}" for k, v in problems.items()))


class Exists(ValueError):
    """The name is taken."""


class Missing(KeyError):
    """No such user, key or token."""


# --- secrets ----------------------------------------------------------------------------------


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret).encode(), stored_hash.encode())


def split_key(raw: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed user key, else None."""
    if not raw.startswith(KEY_PREFIX):
        return None
    key_id, _, secret = raw[len(KEY_PREFIX) :].partition("_")
    if not _ID_RE.match(key_id) or not _SECRET_RE.match(secret):
        return None
    return key_id, secret


def split_token(raw: str) -> tuple[str, str] | None:
    """(name, secret) of a well-formed admin token, else None (names may hold '_'; the hex
    secret never does)."""
    if not raw.startswith(TOKEN_PREFIX):
        return None
    name, _, secret = raw[len(TOKEN_PREFIX) :].rpartition("_")
    if not NAME_RE.match(name) or not _SECRET_RE.match(secret):
        return None
    return name, secret


def looks_like_ours(raw: str) -> bool:
    """A credential in one of this box's formats (a placeholder such as OpenAI clients send,
    "unused" or "sk-…", is not)."""
    return raw.startswith((KEY_PREFIX, TOKEN_PREFIX))


# --- records ----------------------------------------------------------------------------------


def _quotas_dict(q: Quotas) -> dict[str, Any]:
    return {f.name: getattr(q, f.name) for f in fields(Quotas)}


def _quotas_from(d: Mapping[str, Any] | None) -> Quotas:
    names = {f.name for f in fields(Quotas)}
    return Quotas(**{k: v for k, v in (d or {}).items() if k in names})


@dataclass(frozen=True)
class User:
    name: str
    weight: float = 1.0
    quotas: Quotas = field(default_factory=Quotas)
    created: float = 0.0

    def public(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "weight": self.weight,
            "quotas": _quotas_dict(self.quotas),
            "created": self.created,
        }

    def dumps(self) -> str:
        return json.dumps(self.public(), separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> User:
        d = json.loads(raw)
        return cls(
            str(d["name"]),
            float(d.get("weight", 1.0)),
            _quotas_from(d.get("quotas")),
            float(d.get("created", 0)),
        )


@dataclass(frozen=True)
class ApiKey:
    """One key's record: everything but its secret. ``models`` / ``policies``: the names it
    may ask for (None = all); ``monitor``: it may read ``/health`` and ``/metrics``."""

    id: str
    user: str
    hash: str
    created: float = 0.0
    label: str = ""
    models: tuple[str, ...] | None = None
    policies: tuple[str, ...] | None = None
    may_load: bool = True
    route_trace: bool = False
    quotas: Quotas = field(default_factory=Quotas)
    monitor: bool = False

    def public(self) -> dict[str, Any]:
        """The record as the admin API shows it: never the hash."""
        return {
            "id": self.id,
            "user": self.user,
            "created": self.created,
            "label": self.label,
            "models": list(self.models) if self.models is not None else None,
            "policies": list(self.policies) if self.policies is not None else None,
            "may_load": self.may_load,
            "route_trace": self.route_trace,
            "monitor": self.monitor,
            "quotas": _quotas_dict(self.quotas),
        }

    def dumps(self) -> str:
        return json.dumps({**self.public(), "hash": self.hash}, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> ApiKey:
        d = json.loads(raw)
        models, pols = d.get("models"), d.get("policies")
        return cls(
            id=str(d["id"]),
            user=str(d["user"]),
            hash=str(d["hash"]),
            created=float(d.get("created", 0)),
            label=str(d.get("label", "")),
            models=tuple(models) if models is not None else None,
            policies=tuple(pols) if pols is not None else None,
            may_load=bool(d.get("may_load", True)),
            route_trace=bool(d.get("route_trace", False)),
            quotas=_quotas_from(d.get("quotas")),
            monitor=bool(d.get("monitor", False)),
        )


@dataclass(frozen=True)
class AdminToken:
    name: str
    hash: str
    created: float = 0.0

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "created": self.created}

    def dumps(self) -> str:
        return json.dumps({**self.public(), "hash": self.hash}, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> AdminToken:
        d = json.loads(raw)
        return cls(str(d["name"]), str(d["hash"]), float(d.get("created", 0)))


def user_principal(key: ApiKey, user: User) -> Principal:
    return Principal(
        kind="user",
        name=user.name,
        key_id=key.id,
        models=frozenset(key.models) if key.models is not None else None,
        policies=frozenset(key.policies) if key.policies is not None else None,
        may_load=key.may_load,
        route_trace=key.route_trace,
        monitor=key.monitor,
        weight=user.weight,
        user_quotas=user.quotas,
        key_quotas=key.quotas,
    )


def admin_principal(name: str) -> Principal:
    """An admin token used on the API: every model and policy, loads, route traces."""
    return Principal(kind="admin", name=name)


# --- validation of admin bodies (pure) --------------------------------------------------------


def check_name(name: Any, what: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise Invalid({what: "must be 1-64 letters, digits, '.', '_', '@' or '-'"})
    return name


def _body(body: Any, allowed: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    if not isinstance(body, dict):
        raise Invalid({"(body)": "expected a JSON object"})
    problems = {k: "unknown field" for k in body if k not in allowed}
    return body, problems


def _weight(v: Any, problems: dict[str, str]) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= MAX_WEIGHT:
        problems["weight"] = f"must be a number > 0 and <= {MAX_WEIGHT:g}"
        return None
    return float(v)


def parse_quotas(v: Any, base: Quotas, problems: dict[str, str], prefix: str = "quotas") -> Quotas:
    """``base`` with the fields of ``v`` (an object; a field set to null = no limit)."""
    if not isinstance(v, dict):
        problems[prefix] = "expected an object of quota fields"
        return base
    types = {f.name: f.type for f in fields(Quotas)}
    out: dict[str, Any] = {}
    for k, x in v.items():
        where = f"{prefix}.{k}"
        if k not in types:
            problems[where] = "unknown quota"
        elif x is None:
            out[k] = None
        elif k == "load_seconds_per_day":
            if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= MAX_QUOTA:
                problems[where] = "must be null or a number >= 0"
            else:
                out[k] = float(x)
        elif isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_QUOTA:
            problems[where] = "must be null or an integer >= 0"
        else:
            out[k] = x
    return replace(base, **out)


def parse_new_user(body: Any) -> User:
    """``{"name", "weight"?, "quotas"?}`` -> a User (not yet stored)."""
    body, problems = _body(body, ("name", "weight", "quotas"))
    name = body.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        problems["name"] = "must be 1-64 letters, digits, '.', '_', '@' or '-'"
    elif name in RESERVED_USER_NAMES:
        problems["name"] = f"{name!r} is reserved: usage reports show anonymous callers as '-'"
    weight = _weight(body["weight"], problems) if "weight" in body else 1.0
    quotas = parse_quotas(body["quotas"], Quotas(), problems) if "quotas" in body else Quotas()
    if problems:
        raise Invalid(problems)
    return User(str(name), weight or 1.0, quotas, time.time())


def parse_user_patch(user: User, body: Any) -> User:
    """``{"weight"?, "quotas"?}`` applied to ``user`` (quota fields not named are kept)."""
    body, problems = _body(body, ("weight", "quotas"))
    if not body:
        problems["(body)"] = "expected 'weight' and/or 'quotas'"
    weight = _weight(body["weight"], problems) if "weight" in body else user.weight
    quotas = parse_quotas(body["quotas"], user.quotas, problems) if "quotas" in body else None
    if problems:
        raise Invalid(problems)
    return replace(
        user,
        weight=weight if weight is not None else user.weight,
        quotas=quotas if quotas is not None else user.quotas,
    )


def _names(v: Any, what: str, problems: dict[str, str]) -> tuple[str, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > MAX_SCOPE_NAMES:
        problems[what] = f"must be null (all) or a list of at most {MAX_SCOPE_NAMES} names"
        return None
    for i, n in enumerate(v):
        if not isinstance(n, str) or not MODEL_NAME_RE.match(n):
            problems[f"{what}[{i}]"] = f"not a valid name: {n!r}"
    return tuple(dict.fromkeys(v))


def parse_new_key(user: str, body: Any) -> tuple[ApiKey, str]:
    """A key for ``user`` with the scopes of ``body`` and its raw form ``rsk_<id>_<secret>``
    (the only time the secret exists outside the client)."""
    body, problems = _body(
        body or {},
        ("label", "models", "policies", "may_load", "route_trace", "monitor", "quotas"),
    )
    label = body.get("label", "")
    if not isinstance(label, str) or len(label) > MAX_LABEL:
        problems["label"] = f"must be a string of at most {MAX_LABEL} characters"
    models = _names(body.get("models"), "models", problems)
    pols = _names(body.get("policies"), "policies", problems)
    flags = {}
    for flag, default in (("may_load", True), ("route_trace", False), ("monitor", False)):
        v = body.get(flag, default)
        if not isinstance(v, bool):
            problems[flag] = "must be a boolean"
        flags[flag] = bool(v)
    quotas = parse_quotas(body["quotas"], Quotas(), problems) if "quotas" in body else Quotas()
    if problems:
        raise Invalid(problems)
    key_id, secret = secrets.token_hex(8), secrets.token_hex(32)
    key = ApiKey(
        id=key_id,
        user=user,
        hash=hash_secret(secret),
        created=time.time(),
        label=str(label),
        models=models,
        policies=pols,
        quotas=quotas,
        **flags,
    )
    return key, f"{KEY_PREFIX}{key_id}_{secret}"


def new_token(name: str) -> tuple[AdminToken, str]:
    check_name(name)
    if name == DEFAULT_TOKEN:
        raise Invalid({"name": f"'{DEFAULT_TOKEN}' is the box's admin key (RESIDENCY_ADMIN_KEY)"})
    secret = secrets.token_hex(32)
    return AdminToken(name, hash_secret(secret), time.time()), f"{TOKEN_PREFIX}{name}_{secret}"


# --- the store (Redis effects) ----------------------------------------------------------------


def _atomic(r: redis.Redis, watch: tuple[str, ...], body: Callable[[Any], T]) -> T:
    """Run ``body(pipe)`` under WATCH of ``watch``: it reads (immediate mode), calls
    ``pipe.multi()`` and queues its writes; retried when a watched key changed meanwhile."""
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(*watch)
                out = body(pipe)
                pipe.execute()
                return out
            except redis.WatchError:
                continue


def get_user(r: redis.Redis, name: str) -> User | None:
    raw = r.hget(keys.users(), name)
    return User.loads(str(raw)) if raw else None


def all_users(r: redis.Redis) -> list[User]:
    raw: dict[str, str] = r.hgetall(keys.users())  # type: ignore[assignment]
    return sorted((User.loads(v) for v in raw.values()), key=lambda u: u.name)


def add_user(r: redis.Redis, user: User, actor: str) -> User:
    def body(pipe: Any) -> User:
        if pipe.hexists(keys.users(), user.name):
            raise Exists(user.name)
        pipe.multi()
        pipe.hset(keys.users(), user.name, user.dumps())
        audit(pipe, actor, "user.add", user.public())
        return user

    return _atomic(r, (keys.users(),), body)


def update_user(r: redis.Redis, name: str, change: Callable[[User], User], actor: str) -> User:
    """Apply ``change`` (which may raise ``Invalid``) to the stored user."""

    def body(pipe: Any) -> User:
        raw = pipe.hget(keys.users(), name)
        if not raw:
            raise Missing(name)
        user = change(User.loads(raw))
        pipe.multi()
        pipe.hset(keys.users(), name, user.dumps())
        audit(pipe, actor, "user.update", user.public())
        return user

    return _atomic(r, (keys.users(),), body)


def remove_user(r: redis.Redis, name: str, actor: str) -> list[str]:
    """Remove a user and revoke its keys (one MULTI); returns the revoked key ids."""

    def body(pipe: Any) -> list[str]:
        if not pipe.hexists(keys.users(), name):
            raise Missing(name)
        ids = sorted(k.id for k in _keys(pipe) if k.user == name)
        pipe.multi()
        pipe.hdel(keys.users(), name)
        if ids:
            pipe.hdel(keys.api_keys(), *ids)
        audit(pipe, actor, "user.remove", {"name": name, "revoked_keys": ids})
        return ids

    return _atomic(r, (keys.users(), keys.api_keys()), body)


def _keys(r: Any) -> list[ApiKey]:
    raw: dict[str, str] = r.hgetall(keys.api_keys())
    return [ApiKey.loads(v) for v in raw.values()]


def all_keys(r: redis.Redis, user: str | None = None) -> list[ApiKey]:
    out = [k for k in _keys(r) if user is None or k.user == user]
    return sorted(out, key=lambda k: (k.user, k.created, k.id))


def get_key(r: redis.Redis, key_id: str) -> ApiKey | None:
    raw = r.hget(keys.api_keys(), key_id)
    return ApiKey.loads(str(raw)) if raw else None


def issue_key(r: redis.Redis, key: ApiKey, actor: str) -> ApiKey:
    """Store ``key`` (from ``parse_new_key``) if its user still exists."""

    def body(pipe: Any) -> ApiKey:
        if not pipe.hexists(keys.users(), key.user):
            raise Missing(key.user)
        pipe.multi()
        pipe.hset(keys.api_keys(), key.id, key.dumps())
        audit(pipe, actor, "key.issue", key.public())
        return key

    return _atomic(r, (keys.users(),), body)


def revoke_key(r: redis.Redis, key_id: str, actor: str) -> ApiKey:
    def body(pipe: Any) -> ApiKey:
        raw = pipe.hget(keys.api_keys(), key_id)
        if not raw:
            raise Missing(key_id)
        key = ApiKey.loads(raw)
        pipe.multi()
        pipe.hdel(keys.api_keys(), key_id)
        audit(pipe, actor, "key.revoke", {"id": key_id, "user": key.user})
        return key

    return _atomic(r, (keys.api_keys(),), body)


def all_tokens(r: redis.Redis) -> list[AdminToken]:
    raw: dict[str, str] = r.hgetall(keys.admin_tokens())  # type: ignore[assignment]
    return sorted((AdminToken.loads(v) for v in raw.values()), key=lambda t: t.name)


def add_token(r: redis.Redis, token: AdminToken, actor: str) -> AdminToken:
    def body(pipe: Any) -> AdminToken:
        if pipe.hexists(keys.admin_tokens(), token.name):
            raise Exists(token.name)
        pipe.multi()
        pipe.hset(keys.admin_tokens(), token.name, token.dumps())
        audit(pipe, actor, "token.add", token.public())
        return token

    return _atomic(r, (keys.admin_tokens(),), body)


def remove_token(r: redis.Redis, name: str, actor: str) -> None:
    def body(pipe: Any) -> None:
        if not pipe.hexists(keys.admin_tokens(), name):
            raise Missing(name)
        pipe.multi()
        pipe.hdel(keys.admin_tokens(), name)
        audit(pipe, actor, "token.remove", {"name": name})

    _atomic(r, (keys.admin_tokens(),), body)


def token_name(r: redis.Redis, raw: str) -> str | None:
    """The name of the stored admin token ``raw``, or None (unknown, removed, malformed)."""
    parsed = split_token(raw)
    if parsed is None:
        return None
    name, secret = parsed
    stored = r.hget(keys.admin_tokens(), name)
    if not stored or not secret_matches(secret, AdminToken.loads(str(stored)).hash):
        return None
    return name
