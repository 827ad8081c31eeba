"""The one place Redis clients are made: from ``RESIDENCY_REDIS_URL``, plain or Sentinel.

A plain URL (``redis://``, ``rediss://``, ``unix://``) names one server. A Sentinel URL names the
sentinels that watch a primary and its replicas::

    redis+sentinel://[[user]:password@]host1[:port],host2[:port],.../service[/db]
        [?sentinel_password=...&sentinel_username=...]

(port 26379 by default; user and password are the data nodes'; the sentinels' own credentials
go in the query). A Sentinel client's pool is redis-py's ``SentinelConnectionPool``: every new
connection asks the sentinels for the current primary, so after a failover the first error on
an old connection is followed by a reconnect to the promoted replica. Clients derived from a
role's client (the blocking reader, rq's connection) are built by ``pool_like``, so they reach
the same primary the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from residency import keys

SENTINEL_SCHEME = "redis+sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_QUERY = ("sentinel_password", "sentinel_username")
# A sentinel answers from memory: a second is long. A dead sentinel is skipped for the next one
# (no retries here; the connection's own retry asks the sentinels again).
SENTINEL_TIMEOUT_S = 2.0
_SERVICE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class RedisUrlError(ValueError):
    """A malformed Redis URL; ``part`` names what is wrong (``scheme``, ``host 2``, ``db``…)."""

    def __init__(self, part: str, problem: str) -> None:
        self.part = part
        self.problem = problem
        super().__init__(f"{part}: {problem}")


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


class FollowingConnection(SentinelManagedConnection):
    """A Sentinel-managed connection that asks the sentinels again whenever it reconnects.

    redis-py reconnects a dropped connection inside a command (its retry, the health check, a
    single-connection client's next command) through ``send_packed_command``, which connects to
    the connection's last address and skips the Sentinel lookup that only ``connect`` does: a
    connection that was on the primary that died would knock on its port forever (a blocking
    reader, which never goes back to its pool, most of all). Connecting here first, the
    Sentinel way, makes every reconnect go to the primary the sentinels name now."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            self.connect()
        super().send_packed_command(command, check_health)


def parse(url: str) -> SentinelTarget | None:
    """The Sentinel target a URL names, or None for a plain URL. Raises ``RedisUrlError`` naming
    the bad part (so a typo stops every role at start, not at its first Redis call)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise RedisUrlError("scheme", f"expected SCHEME://…, one of {_schemes()}")
    if scheme in PLAIN_SCHEMES:
        return None
    if scheme != SENTINEL_SCHEME:
        raise RedisUrlError("scheme", f"unknown scheme {scheme!r}, expected one of {_schemes()}")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        creds, _, netloc = netloc.rpartition("@")
        user, colon, pw = creds.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
        if not colon:  # redis-style "password@" without a colon is ambiguous: refuse it
            raise RedisUrlError("password", "write credentials as ':password@' or 'user:password@'")
    sentinels = tuple(_host(part, i) for i, part in enumerate(netloc.split(","), 1))
    if not slash or not path:
        raise RedisUrlError("service", "missing: …/SERVICE[/DB] after the sentinel hosts")
    service, _, db_text = path.partition("/")
    if not _SERVICE_RE.match(service):
        raise RedisUrlError("service", f"{service!r} is not a Sentinel service (master) name")
    db = 0
    if db_text.strip("/"):
        if not db_text.strip("/").isdigit():
            raise RedisUrlError("db", f"{db_text!r} is not a database number")
        db = int(db_text.strip("/"))
    extra: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in SENTINEL_QUERY:
            raise RedisUrlError(f"query {name}", f"unknown option, expected {SENTINEL_QUERY}")
        extra[name] = value
    return SentinelTarget(
        sentinels=sentinels,
        service=service,
        db=db,
        username=username,
        password=password,
        sentinel_username=extra.get("sentinel_username") or None,
        sentinel_password=extra.get("sentinel_password") or None,
    )


def _schemes() -> str:
    return ", ".join(f"{s}://" for s in (*PLAIN_SCHEMES, SENTINEL_SCHEME))


def _host(part: str, i: int) -> tuple[str, int]:
    what = f"sentinel host {i}"
    if not part:
        raise RedisUrlError(what, "empty (hosts are HOST[:PORT] separated by commas)")
    if part.startswith("["):  # [IPv6]:port
        host, bracket, tail = part[1:].partition("]")
        if not bracket or not host or (tail and not tail.startswith(":")):
            raise RedisUrlError(what, f"{part!r} is not [IPV6][:PORT]")
        port_text = tail[1:] if tail else ""
    else:
        host, _, port_text = part.partition(":")
        if not _HOST_RE.match(host):
            raise RedisUrlError(what, f"{host!r} is not a host name or address")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise RedisUrlError(what, f"port {port_text!r} is not 1-65535")
    return host, int(port_text)


def is_sentinel(url: str | None) -> bool:
    return url is not None and url.partition("://")[0] == SENTINEL_SCHEME


def client(
    url: str,
    *,
    max_connections: int | None = None,
    sentinel_timeout: float = SENTINEL_TIMEOUT_S,
    **options: Any,
) -> redis.Redis:
    """A client for ``url`` with these connection ``options`` (timeouts, retry, decoding); for
    a Sentinel URL one whose pool follows the primary the sentinels name."""
    target = parse(url)
    if target is None:
        return redis.Redis.from_url(url, max_connections=max_connections, **options)
    sentinel = Sentinel(
        list(target.sentinels),
        sentinel_kwargs={
            "socket_timeout": sentinel_timeout,
            "socket_connect_timeout": sentinel_timeout,
            "retry": Retry(NoBackoff(), 0),
            "username": target.sentinel_username,
            "password": target.sentinel_password,
        },
    )
    return sentinel.master_for(
        target.service,
        redis_class=redis.Redis,
        connection_pool_class=SentinelConnectionPool,
        connection_class=FollowingConnection,
        db=target.db,
        username=target.username,
        password=target.password,
        max_connections=max_connections,
        **options,
    )


def pool_like(r: redis.Redis, **overrides: Any) -> redis.ConnectionPool:
    """A new pool reaching the same server (or Sentinel service) as ``r`` with its options, some
    changed: for a connection of its own (a blocking reader) or other reply decoding (rq)."""
    pool = r.connection_pool
    kwargs = {**pool.connection_kwargs, **overrides}
    if isinstance(pool, SentinelConnectionPool):
        kwargs.pop("connection_pool", None)  # the old pool's proxy; the new pool sets its own
        return SentinelConnectionPool(
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            **kwargs,
        )
    return redis.ConnectionPool(pool.connection_class, **kwargs)


def connect(url: str, max_connections: int | None = None) -> redis.Redis:
    """Every role's Redis client. Timeouts everywhere: no call can wait forever. A failed
    command is retried briefly (3 tries within about 0.3 s: a dropped connection to a live
    server, or a primary the sentinels have not replaced yet), not with redis-py's default
    backoff of seconds: during an outage or a failover each role has its own retry (loops, the
    model process's backoff) and web answers 503 without making its client wait.
    ``max_connections``: the pool's bound (redis-py's default, 100, is far below what a gevent
    web worker holds: a connection per waiting request)."""
    return client(
        url,
        max_connections=max_connections,
        decode_responses=True,
        socket_timeout=30,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 3),
    )


def probe(url: str, timeout: float = 1.0) -> redis.Redis:
    """A client that answers at once whether Redis is reachable: short timeouts and no retries
    (redis-py retries a refused connection with backoff by default, seconds). For readiness
    checks and for waiting on a starting server."""
    return client(
        url,
        sentinel_timeout=timeout,
        decode_responses=True,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


class NotReplicated(RuntimeError):
    """Fewer replicas than asked acknowledged a write within the wait."""

    def __init__(self, acked: int, wanted: int, wait_ms: int) -> None:
        self.acked = acked
        self.wanted = wanted
        self.wait_ms = wait_ms
        super().__init__(f"{acked} of {wanted} replicas acknowledged within {wait_ms} ms")


def confirm_replicated(r: redis.Redis, replicas: int, wait_ms: int) -> int:
    """Block until ``replicas`` replicas hold every write this server committed so far, or
    raise ``NotReplicated`` after ``wait_ms``. WAIT counts the writes of its own connection: one
    write of a marker on the same connection (pipelined with the WAIT) makes that connection's
    offset at least that of every write acknowledged before this call, whichever connection
    made it (the replication stream is one ordered log). Returns the replicas that acked."""
    with r.pipeline(transaction=False) as pipe:
        pipe.incr(keys.replication_mark())
        pipe.execute_command("WAIT", replicas, wait_ms)
        acked = int(pipe.execute()[1])
    if acked < replicas:
        raise NotReplicated(acked, replicas, wait_ms)
    return acked
