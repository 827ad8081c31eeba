"""A coordinator leader driven by hand against a real Redis: no threads, no agent; a test plants
the state it needs (worker records, model hashes, queues), runs passes with ``step`` and looks at
what they wrote. The clock is a list the test moves."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import redis

from coordinator.loop import Coordinator
from residency import keys
from residency.box import Box, connect
from residency.messages import Kind, Request
from tests.conftest import tiny_models, write_config


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def hand_leader(
    tmp_path: Path,
    redis_url: str,
    models_dir: Path,
    clock: Clock,
    *,
    pool: dict[str, Any] | None = None,
    models: dict[str, dict[str, Any]] | None = None,
) -> Coordinator:
    cfg = write_config(
        tmp_path / "config.toml",
        {
            "server": {"model_dirs": [str(models_dir)]},
            "pool": pool or {},
            "models": models if models is not None else tiny_models(models_dir),
        },
    )
    box = Box(data_dir=tmp_path / "data", config_path=cfg, redis_url=redis_url, environ={})
    co = Coordinator(box, connect(redis_url), clock=clock)
    assert co.try_lead()
    # Nobody renews this lease (no threads): make it outlast a slow test on a busy machine.
    co.r.pexpire(keys.leader(), 600_000)
    co.r.delete(keys.events())  # the lead's own config event: passes are driven by hand here
    return co


def live_worker(r: redis.Redis, host: str, children: dict[str, str], children_at: float) -> None:
    """A worker record as the agent's heartbeat writes it, reporting ``children``."""
    r.hset(
        keys.worker(host),
        mapping={
            "devices": json.dumps(["cpu"]),
            "memory": "{}",
            "pid": 1,
            "last_heartbeat": children_at,
            "children": json.dumps(children),
            "children_at": children_at,
        },
    )
    r.expire(keys.worker(host), 60)
    r.sadd(keys.workers(), host)
    r.hset(keys.hosts_seen(), host, children_at)


def plant_model(r: redis.Redis, name: str, **fields: Any) -> None:
    """A model's state hash, registered in the set of models with state as start_load does."""
    r.hset(keys.model(name), mapping={k: str(v) for k, v in fields.items()})
    r.sadd(keys.models_with_state(), name)


def request(model: str, submitted: float) -> Request:
    return Request(
        id=uuid.uuid4().hex,
        kind=Kind.CHAT,
        model=model,
        params={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        stream=False,
        submitted=submitted,
    )


def queue(r: redis.Redis, model: str, submitted: float) -> Request:
    req = request(model, submitted)
    r.lpush(keys.queue(model), req.dumps())
    return req


def reply_of(r: redis.Redis, req: Request) -> list[tuple[str, dict[str, Any]]]:
    """The reply messages written for ``req`` so far, as (type, data)."""
    out = []
    for _, fields in r.xrange(keys.reply(req.id)):
        out.append((str(fields["t"]), json.loads(fields["d"])))
    return out
