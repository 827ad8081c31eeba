"""Pure parts of users and keys: ``[auth] required`` follows the bound address, key formats,
and admin bodies checked all at once."""

from __future__ import annotations

import pytest

from residency import users
from residency.auth import Quotas
from residency.settings import SettingsError, build, env_layer, validate_patch


@pytest.mark.parametrize(
    ("host", "required"),
    [
        ("127.0.0.1", False),
        ("127.0.0.2", False),
        ("::1", False),
        ("localhost", False),
        ("0.0.0.0", True),
        ("::", True),
        ("10.0.0.5", True),
        ("box.example", True),
    ],
)
def test_auth_required_auto_follows_the_host(host: str, required: bool) -> None:
    assert build({"server": {"host": host}}).auth_required is required


def test_auth_required_explicit_wins_and_is_restart_only() -> None:
    assert (
        build({"server": {"host": "0.0.0.0"}, "auth": {"required": False}}).auth_required is False
    )
    assert build({"auth": {"required": True}}).auth_required is True
    env = env_layer({"RESIDENCY_AUTH_REQUIRED": "false", "RESIDENCY_AUTH_PUBLIC_HEALTH": "true"})
    s = build({"server": {"host": "0.0.0.0"}}, env)
    assert (s.auth_required, s.auth.public_health) == (False, True)
    with pytest.raises(SettingsError) as e:
        validate_patch(build({}), {"auth": {"required": False, "public_health": True}})
    assert set(e.value.problems) == {"auth.required", "auth.public_health"}


def test_key_and_token_formats() -> None:
    key, raw = users.parse_new_key("alice", {})
    key_id, secret = users.split_key(raw) or ("", "")
    assert key_id == key.id and users.secret_matches(secret, key.hash)
    assert not users.secret_matches(secret[:-1] + "x", key.hash)
    for bad in ("rsk_", "rsk_abc_def", raw + "0", raw.upper(), "sk-" + raw[4:]):
        assert users.split_key(bad) is None
    token, raw_token = users.new_token("ops_team.1")
    assert users.split_token(raw_token) == ("ops_team.1", raw_token.rsplit("_", 1)[1])
    assert users.split_token("rsa_" + "0" * 64) is None
    assert users.looks_like_ours(raw) and users.looks_like_ours(raw_token)
    assert not users.looks_like_ours("unused")
    assert token.hash == users.hash_secret(raw_token.rsplit("_", 1)[1])


def test_key_defaults_and_scopes() -> None:
    key, _ = users.parse_new_key("alice", {})
    assert (key.models, key.policies, key.may_load, key.route_trace) == (None, None, True, False)
    key, _ = users.parse_new_key(
        "alice", {"models": ["a", "a", "b"], "policies": [], "quotas": {"concurrent": 2}}
    )
    assert (key.models, key.policies, key.quotas) == (("a", "b"), (), Quotas(concurrent=2))
    p = users.user_principal(key, users.User("alice", 2.0, Quotas(tokens_per_day=5)))
    assert p.may_use_model("a") and not p.may_use_model("c") and not p.may_use_policy("x")
    assert (p.weight, p.user_quotas.tokens_per_day, p.key_quotas.concurrent) == (2.0, 5, 2)
    assert users.ApiKey.loads(key.dumps()) == key


def test_bad_bodies_name_every_field() -> None:
    with pytest.raises(users.Invalid) as e:
        users.parse_new_user({"name": "x" * 65, "weight": True, "quotas": {"tokens": 1}})
    assert set(e.value.problems) == {"name", "weight", "quotas.tokens"}
    with pytest.raises(users.Invalid) as e:
        users.parse_new_key(
            "alice",
            {"label": 1, "models": "a", "route_trace": 1, "quotas": {"concurrent": 1.5}},
        )
    assert set(e.value.problems) == {"label", "models", "route_trace", "quotas.concurrent"}
    with pytest.raises(users.Invalid) as e:
        users.new_token("default")
    assert set(e.value.problems) == {"name"}
