"""Clients of a `redis+sentinel://` URL across a failover (SIGKILL of the primary): the role's
client, a Waker's blocking reader (which never goes back to a pool) and rq's connection all
reconnect to the promoted replica; WAIT-backed admin acknowledgement counts the replica."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import retry
from residency.loops import Waker, blmove
from residency.redis_conn import NotReplicated, confirm_replicated, connect, probe
from tests.sentinels import SentinelSet, eventually


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    s = SentinelSet(tmp_path / "redis")
    try:
        s.start()
        yield s
    finally:
        s.stop()


def test_every_kind_of_client_follows_the_promoted_replica(sentinels: SentinelSet) -> None:
    r = connect(sentinels.url)
    stop = threading.Event()
    waker = Waker(r, stop)
    rq_conn = retry.connection(r)
    try:
        r.rpush("src", "one")
        with waker.reading() as blocking:
            assert blmove(blocking, "src", "dst", 1, "LEFT", "RIGHT") == "one"
        old_id = waker.client_id()
        retry.queue(rq_conn).empty()
        assert confirm_replicated(r, 1, 5000) == 1

        sentinels.primary.kill()
        eventually(lambda: sentinels.primary_port() == sentinels.replica.port, "the promotion")

        # The role's client: its pooled connections reconnect to the new primary.
        eventually(lambda: r.rpush("src", "two") > 0, "a write through the role's client")
        assert int(str(r.info("server")["tcp_port"])) == sentinels.replica.port

        # The blocking reader: the same connection, reconnected, with its new id re-read.
        def moved() -> bool:
            with waker.reading() as blocking:
                return blmove(blocking, "src", "dst", 1, "LEFT", "RIGHT") == "two"

        eventually(moved, "a blocking read on the new primary")
        assert waker.client_id() != old_id
        assert waker.client_id() in {int(c["id"]) for c in r.client_list()}
        # rq's undecoded connection.
        eventually(lambda: retry.queue(rq_conn).count == 0, "rq on the new primary")
        assert r.lrange("dst", 0, -1) == ["one", "two"]  # the replica had the first move
        # A readiness probe.
        assert probe(sentinels.url).ping()
        # No replica left: a write cannot be acknowledged by one.
        with pytest.raises(NotReplicated) as e:
            confirm_replicated(r, 1, 200)
        assert (e.value.acked, e.value.wanted) == (0, 1)
    finally:
        stop.set()
        waker.close()
        r.close()


def test_a_write_is_acknowledged_only_once_the_replica_holds_it(sentinels: SentinelSet) -> None:
    r = connect(sentinels.url)
    replica = sentinels.replica
    assert replica.proc is not None
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        r.set("k", "v1")
        with pytest.raises(NotReplicated):
            confirm_replicated(r, 1, 300)
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    r.set("k", "v2")
    assert confirm_replicated(r, 1, 10_000) == 1
    # Acknowledged: the replica holds it (the write came from another connection of the pool).
    assert replica.client().get("k") == "v2"
    r.close()
