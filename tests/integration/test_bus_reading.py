"""A request whose reply its web thread stops reading, for any reason, does not go on being
served for nobody: it is withdrawn from its queue (or cancelled, once taken)."""

from __future__ import annotations

import pytest
import redis

from residency import keys
from residency.lua import Scripts
from residency.messages import Kind
from web import bus


def test_a_reply_that_cannot_be_read_withdraws_its_request(r: redis.Redis) -> None:
    call = bus.submit(
        r,
        Scripts(r),
        kind=Kind.CHAT,
        model="a",
        params={"messages": [{"role": "user", "content": "hi"}]},
        stream=False,
        bound=-1,
        timeout_s=30,
        user="user:ann",
    )
    assert r.llen(keys.queue("a")) == 1
    r.xadd(keys.reply(call.req.id), {"t": "no-such-type", "d": ""})
    with pytest.raises(ValueError):
        call.result()
    assert r.llen(keys.queue("a")) == 0


def _stream_call(r: redis.Redis) -> bus.Call:
    return bus.submit(
        r,
        Scripts(r),
        kind=Kind.CHAT,
        model="a",
        params={"messages": [{"role": "user", "content": "hi"}]},
        stream=True,
        bound=-1,
        timeout_s=30,
        user="user:ann",
    )


def test_a_streams_end_is_handed_on_before_its_reply_stream_is_deleted(r: redis.Redis) -> None:
    """The last batch reaches the reader while the reply stream still exists (its deletion is a
    round trip the client need not wait for); reading on deletes it, and nothing is withdrawn
    or cancelled for a reply that was complete."""
    call = _stream_call(r)
    r.lpop(keys.queue("a"))  # a model process took it
    reply = keys.reply(call.req.id)
    r.xadd(reply, {"t": "chunk", "d": '{"chunks": [{"choices": []}]}'})
    r.xadd(reply, {"t": "done", "d": ""})
    batches = call.batches()
    assert next(b for b in batches if b.last).last
    assert r.exists(reply) == 1  # handed on first
    assert next(batches, None) is None
    assert r.exists(reply) == 0
    assert r.exists(keys.cancel(call.req.id)) == 0


def test_a_complete_reply_left_unread_is_still_deleted_and_not_cancelled(r: redis.Redis) -> None:
    call = _stream_call(r)
    r.lpop(keys.queue("a"))
    reply = keys.reply(call.req.id)
    r.xadd(reply, {"t": "done", "d": ""})
    batches = call.batches()
    assert next(batches).last
    batches.close()  # the reader stops there (its client got everything)
    assert r.exists(reply) == 0
    assert r.exists(keys.cancel(call.req.id)) == 0
