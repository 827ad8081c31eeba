"""A model process's reply and its bookkeeping, against a real Redis and the tiny llama.cpp model.

The race reproduced here: a process that wrote a request's last reply message and then died
before taking the request off its processing list had it requeued by ``hand_back`` once the
client had read the reply and deleted the stream, so one request was generated twice. The last
message and the removal from the processing list are now one script: no Redis client can ever
see a complete reply for a request that is still being processed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from residency import keys
from residency.messages import Kind, Request, new_request_id
from residency.route_wait import Service
from residency.settings import ModelSpec
from workers.model_process import ModelProcess
from workers.runtime import LlamaRuntime


@pytest.fixture
def proc(r: redis.Redis, models_dir: Path) -> Iterator[ModelProcess]:
    runtime = LlamaRuntime()
    spec = ModelSpec(path=str(models_dir / "tiny0.gguf"), n_ctx=512)
    runtime.load(spec, "cpu")
    yield ModelProcess(
        r,
        model="a",
        token="t1",
        device="cpu",
        spec=spec,
        runtime=runtime,
        stop=threading.Event(),
    )
    runtime.close()


def monitored(r: redis.Redis, action: Any) -> list[dict[str, Any]]:
    """Every command Redis executed while ``action`` ran, in order (MONITOR)."""
    seen: list[dict[str, Any]] = []
    started = threading.Event()
    marker = f"end-{new_request_id()}"

    def watch() -> None:
        with r.monitor() as m:
            started.set()
            for cmd in m.listen():
                if marker in cmd["command"]:
                    return
                seen.append(cmd)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    assert started.wait(10)
    time.sleep(0.1)  # MONITOR is registered once its reply is read; give it that round trip
    action()
    r.echo(marker)
    t.join(10)
    assert not t.is_alive()
    return seen


@pytest.mark.parametrize("stream", [False, True])
def test_the_last_reply_and_the_processing_removal_are_one_step(
    r: redis.Redis, proc: ModelProcess, stream: bool
) -> None:
    req = Request(
        id=new_request_id(),
        kind=Kind.CHAT,
        model="a",
        params={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        stream=stream,
        submitted=time.time(),
    )
    raw = req.dumps()
    r.lpush(keys.processing("a"), raw)  # where the serve loop's BLMOVE puts it

    cmds = monitored(r, lambda: proc.handle(raw))

    reply_key = keys.reply(req.id)
    writes = [c for c in cmds if c["command"].upper().startswith(f"XADD {reply_key}".upper())]
    assert writes, "no reply was written"
    last = writes[-1]
    assert " done " in f" {last['command']} ", last
    # The final message is written from inside the script that also takes the request off the
    # processing list, never by a plain command before it.
    assert last["client_type"] == "lua", last
    removals = [c for c in cmds if c["command"].upper().startswith("LREM")]
    assert len(removals) == 1 and removals[0]["client_type"] == "lua"
    assert cmds.index(last) < cmds.index(removals[0])
    assert r.llen(keys.processing("a")) == 0
    assert r.xrange(reply_key)[-1][1]["t"] == "done"


def test_a_streams_last_chunks_and_the_service_time_ride_in_the_finish_script(
    r: redis.Redis, proc: ModelProcess
) -> None:
    """The chunks a stream holds when it ends and the model's service time are written by the
    script that writes its last reply (one round trip), in order: chunks, then done."""
    req = Request(
        id=new_request_id(),
        kind=Kind.CHAT,
        model="a",
        params={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        stream=True,
        submitted=time.time(),
    )
    raw = req.dumps()
    r.lpush(keys.processing("a"), raw)
    cmds = monitored(r, lambda: proc.handle(raw))

    reply_key = keys.reply(req.id).upper()
    writes = [i for i, c in enumerate(cmds) if c["command"].upper().startswith(f"XADD {reply_key}")]
    # Chunks are written by scripts too (flush.lua): the finish script is the last one run.
    [removal] = [i for i, c in enumerate(cmds) if c["command"].upper().startswith("LREM")]
    finish = max(
        i
        for i, c in enumerate(cmds[:removal])
        if c["client_type"] != "lua" and c["command"].upper().startswith("EVALSHA")
    )
    by_finish = [cmds[i] for i in writes if i > finish]
    assert all(c["client_type"] == "lua" for c in by_finish)
    assert len(by_finish) == 2, writes  # the last chunks, then done
    assert (
        " chunk " in f" {by_finish[0]['command']} " and " done " in f" {by_finish[1]['command']} "
    )
    service = [
        c for c in cmds if c["command"].upper().startswith(f"SET {keys.service('a')}".upper())
    ]
    assert [c["client_type"] for c in service] == ["lua"]
    pace = Service.parse(r.get(keys.service("a")))
    assert pace.service_s is not None and pace.service_s > 0
    # Every chunk reached the stream, the one with the finish reason last among them.
    entries = [f for _, f in r.xrange(keys.reply(req.id))]
    assert [f["t"] for f in entries][-1] == "done"
    chunks = [c for f in entries if f["t"] == "chunk" for c in json.loads(f["d"])["chunks"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_a_long_stream_renews_its_reply_ttl(
    proc: ModelProcess, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that runs longer than the reply TTL must not lose its key mid-reply: the TTL is
    renewed while it runs (here on every flush, and the key is made to age between chunks)."""
    import workers.model_process as mp

    monkeypatch.setattr(mp, "RENEW_TTL_S", 0.0)
    req = Request(new_request_id(), Kind.CHAT, "a", {}, True, time.time())
    reply = keys.reply(req.id)

    def chunks() -> Iterator[dict[str, Any]]:
        for i in range(4):
            if i:
                r.expire(reply, 5)  # the key ages as a long stream's would
                time.sleep(mp.FLUSH_EVERY_S * 2)  # so this chunk is due for a flush
            yield {"choices": [{"delta": {"content": f"t{i}"}}]}

    assert proc.stream(req, chunks()) is not None
    ttl = int(r.ttl(reply))
    assert ttl > 5, ttl
