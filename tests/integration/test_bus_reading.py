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
