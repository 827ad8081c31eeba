"""The pure decisions of web/guard.py: which Host names, Origins and content types a request
may carry (the HTTP behaviour is tested through the app in tests/integration/test_web_guard.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from residency import supervisor
from residency.settings import SettingsError, build, is_loopback
from web.guard import Rules, host_allowed, is_json, origin_allowed, same_origin, split_host

DEFAULT = Rules.of(build({}))


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:8000",
        "LOCALHOST:8000",
        "127.0.0.1",
        "127.0.0.1:8000",
        "127.8.9.10:1",
        "[::1]",
        "[::1]:8000",
    ],
)
def test_loopback_names_are_accepted_with_or_without_a_port(host: str) -> None:
    assert host_allowed(host, DEFAULT)


@pytest.mark.parametrize(
    "host",
    [
        "",
        "evil.example",
        "evil.example:8000",
        "localhost.evil.example",
        "127.0.0.1.evil.example",
        "10.0.0.5:8000",
        "[::2]:8000",
        "::1",  # an IPv6 Host must be bracketed
        "localhost:80x",
        "[::1",
        "[::1]x",
    ],
)
def test_other_names_are_refused(host: str) -> None:
    assert not host_allowed(host, DEFAULT)


def test_the_bind_address_and_listed_names_are_accepted() -> None:
    rules = Rules.of(
        build({"server": {"host": "10.0.0.5", "allowed_hosts": ["Box.Example", "web"]}})
    )
    for host in ("10.0.0.5:8000", "box.example", "BOX.example:443", "web:8000", "localhost"):
        assert host_allowed(host, rules), host
    assert not host_allowed("other.example", rules)
    v6 = Rules.of(build({"server": {"host": "fd00::5"}}))
    assert host_allowed("[fd00::5]:8000", v6)


def test_allowed_hosts_and_origins_are_validated() -> None:
    with pytest.raises(SettingsError) as e:
        build({"server": {"allowed_hosts": ["http://box.example"], "cors_origins": ["x.example"]}})
    assert set(e.value.problems) == {"server.allowed_hosts", "server.cors_origins"}
    for bad in ("https://app.example/", "https://app.example/path", "ftp://app.example", "*"):
        with pytest.raises(SettingsError):
            build({"server": {"cors_origins": [bad]}})
    for bad in ("box.example:8000", "a b", "", "[::1"):
        with pytest.raises(SettingsError):
            build({"server": {"allowed_hosts": [bad]}})


def test_an_origin_is_the_boxs_own_only_at_the_same_host_and_port() -> None:
    assert same_origin("http://localhost:8000", "localhost:8000")
    assert same_origin("https://box.example", "box.example")
    assert same_origin("https://box.example:443", "box.example")
    assert same_origin("http://[::1]:8000", "[::1]:8000")
    assert not same_origin("http://localhost:8001", "localhost:8000")
    assert not same_origin("http://evil.example", "localhost:8000")
    assert not same_origin("https://box.example", "box.example:8443")
    assert not same_origin("null", "localhost:8000")
    assert not same_origin("localhost:8000", "localhost:8000")


def test_foreign_origins_pass_only_when_listed() -> None:
    rules = Rules.of(build({"server": {"cors_origins": ["https://App.example"]}}))
    assert origin_allowed(None, "localhost:8000", DEFAULT)  # not a browser's cross-origin call
    assert origin_allowed("http://localhost:8000", "localhost:8000", DEFAULT)
    assert not origin_allowed("https://app.example", "localhost:8000", DEFAULT)
    assert origin_allowed("https://app.example", "localhost:8000", rules)
    assert not origin_allowed("http://app.example", "localhost:8000", rules)
    assert not origin_allowed("null", "localhost:8000", rules)


def test_only_json_bodies() -> None:
    assert is_json("application/json")
    assert is_json("application/json; charset=utf-8")
    assert is_json("Application/JSON")
    for other in (
        None,
        "",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ):
        assert not is_json(other)
    assert not is_json("application/jsonp")


def test_split_host() -> None:
    assert split_host("Box.Example:8000") == ("box.example", 8000)
    assert split_host("[::1]") == ("[::1]", None)
    assert split_host("box:") is None


def test_the_demo_config_opens_the_api_only_when_asked() -> None:
    def auth_of(text: str) -> tuple[bool, bool]:
        s = build(tomllib.loads(text))
        return s.auth.required, s.auth.public_health

    closed = supervisor.demo_config(Path("/m/a.gguf"), Path("/m/b.gguf"))
    opened = supervisor.demo_config(Path("/m/a.gguf"), Path("/m/b.gguf"), open_api=True)
    assert auth_of(closed) == (True, False)
    assert auth_of(opened) == (False, False)  # /health and /metrics still need the admin key
    # `residency up` asks for it on a loopback bind only.
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost")] == [True] * 4
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "box.example"))
