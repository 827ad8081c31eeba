"""Pure parts of users and keys: ``[auth] required`` by default, key formats, subjects, and
admin bodies checked all at once."""

from __future__ import annotations

import pytest

from residency import users
from residency.auth import ANONYMOUS, Quotas, subject_label
from residency.settings import SettingsError, build, env_layer, validate_patch
from web import quota


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "0.0.0.0", "box.example"])
def test_auth_is_required_by_default_whatever_the_host(host: str) -> None:
    # A loopback bind is reachable from every page the operator's browser opens.
    assert build({"server": {"host": host}}).auth.required is True


def test_auth_required_explicit_wins_and_is_restart_only() -> None:
    assert (
        build({"server": {"host": "0.0.0.0"}, "auth": {"required": False}}).auth.required is False
    )
    env = env_layer({"RESIDENCY_AUTH_REQUIRED": "false", "RESIDENCY_AUTH_PUBLIC_HEALTH": "true"})
    s = build({"server": {"host": "0.0.0.0"}}, env)
    assert (s.auth.required, s.auth.public_health) == (False, True)
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


def test_subjects_are_namespaced_and_labelled_apart() -> None:
    key, _ = users.parse_new_key("ops", {})
    user = users.user_principal(key, users.User("ops"))
    admin = users.admin_principal("ops")
    # An admin token named like a user is another subject: it never spends that user's quota.
    assert (user.subject, admin.subject, ANONYMOUS.subject) == ("user:ops", "admin:ops", "anon")
    assert len({user.subject, admin.subject, ANONYMOUS.subject}) == 3
    labels = [subject_label(p.subject) for p in (user, admin, ANONYMOUS)]
    assert labels == ["ops", "admin:ops", "-"]
    # The quota of a user is keyed by its subject, so the usage its requests count meets it.
    assert quota.subjects(users.user_principal(key, users.User("ops", quotas=Quotas(1)))) == [
        ("user", "user:ops", Quotas(1))
    ]


def test_reserved_user_names_are_refused() -> None:
    for name in ("-", "user:ops", "admin:ops", "a|b"):
        with pytest.raises(users.Invalid) as e:
            users.parse_new_user({"name": name})
        assert set(e.value.problems) == {"name"}, name
    assert users.parse_new_user({"name": "anon"}).name == "anon"  # its subject is user:anon


def test_monitor_is_a_key_scope_off_by_default() -> None:
    plain, _ = users.parse_new_key("prom", {})
    scrape, _ = users.parse_new_key("prom", {"monitor": True, "models": []})
    assert (plain.monitor, scrape.monitor) == (False, True)
    assert users.ApiKey.loads(scrape.dumps()) == scrape
    u = users.User("prom")
    assert not users.user_principal(plain, u).may_monitor
    p = users.user_principal(scrape, u)
    assert p.may_monitor and not p.may_use_model("a")
    assert users.admin_principal("ops").may_monitor and not ANONYMOUS.may_monitor
    with pytest.raises(users.Invalid) as e:
        users.parse_new_key("prom", {"monitor": "yes"})
    assert set(e.value.problems) == {"monitor"}
