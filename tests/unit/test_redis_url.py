"""RESIDENCY_REDIS_URL: plain URLs pass through, Sentinel URLs are parsed, and a malformed one is
an error at start that names the bad part."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.sentinel import SentinelConnectionPool

from residency.box import Box
from residency.redis_conn import (
    RedisUrlError,
    SentinelTarget,
    connect,
    is_sentinel,
    parse,
    pool_like,
    probe,
)
from residency.settings import SettingsError


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://:pw@h/1", "unix:///tmp/r.sock"])
def test_a_plain_url_names_no_sentinels(url: str) -> None:
    assert parse(url) is None
    assert not is_sentinel(url)


def test_a_sentinel_url_names_its_sentinels_service_db_and_credentials() -> None:
    url = (
        "redis+sentinel://:s%40cret@10.0.0.1:26380,sent-2,[::1]:26381/main/3"
        "?sentinel_password=sp&sentinel_username=su"
    )
    assert is_sentinel(url)
    assert parse(url) == SentinelTarget(
        sentinels=(("10.0.0.1", 26380), ("sent-2", 26379), ("::1", 26381)),
        service="main",
        db=3,
        username=None,
        password="s@cret",
        sentinel_username="su",
        sentinel_password="sp",
    )
    assert parse("redis+sentinel://u:p@h/svc") == SentinelTarget(
        sentinels=(("h", 26379),), service="svc", db=0, username="u", password="p"
    )


@pytest.mark.parametrize(
    ("url", "part"),
    [
        ("localhost:6379", "scheme"),
        ("http://h:1/", "scheme"),
        ("redis+sentinel://h1:26379,,h3/svc", "sentinel host 2"),
        ("redis+sentinel://h1:26379,h2:port/svc", "sentinel host 2"),
        ("redis+sentinel://h1:70000/svc", "sentinel host 1"),
        ("redis+sentinel://[::1/svc", "sentinel host 1"),
        ("redis+sentinel://h1,h2", "service"),
        ("redis+sentinel://h1/", "service"),
        ("redis+sentinel://h1/a b", "service"),
        ("redis+sentinel://h1/svc/x", "db"),
        ("redis+sentinel://h1/svc?password=x", "query password"),
        ("redis+sentinel://secret@h1/svc", "password"),
    ],
)
def test_a_malformed_url_names_the_bad_part(url: str, part: str) -> None:
    with pytest.raises(RedisUrlError) as e:
        parse(url)
    assert e.value.part == part
    assert str(e.value).startswith(part + ":")


def test_a_malformed_url_stops_a_process_at_start(tmp_path: Path) -> None:
    box = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url="redis+sentinel://h1:26379,h2:x/svc",
        environ={},
    )
    with pytest.raises(SettingsError) as e:
        box.base_settings()
    assert list(e.value.problems) == ["RESIDENCY_REDIS_URL"]
    assert "sentinel host 2" in e.value.problems["RESIDENCY_REDIS_URL"]
    good = Box(data_dir=tmp_path, config_path=None, redis_url="redis+sentinel://h1/svc", environ={})
    assert good.base_settings().server.redis_min_replicas == 1


def test_every_client_of_a_sentinel_url_follows_the_primary() -> None:
    """No server is contacted: building clients is lazy. Each one's pool asks the sentinels for
    the primary, with the role's options kept (pool size, timeouts, decoding)."""
    url = "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/svc/2?sentinel_password=sp"
    r = connect(url, max_connections=77)
    pool = r.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "svc"
    assert pool.max_connections == 77
    kw = pool.connection_kwargs
    assert (kw["db"], kw["password"], kw["decode_responses"]) == (2, "pw", True)
    assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (30, 5)
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
    # Derived pools (a blocking reader, rq's undecoded connection) reach the same service.
    other = pool_like(r, decode_responses=False)
    assert isinstance(other, SentinelConnectionPool)
    assert other is not pool and other.service_name == "svc"
    assert other.sentinel_manager is pool.sentinel_manager
    assert other.connection_kwargs["decode_responses"] is False
    assert other.connection_kwargs["connection_pool"] is other.proxy
    assert isinstance(probe(url, 0.5).connection_pool, SentinelConnectionPool)
