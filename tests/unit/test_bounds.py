"""The pure parts of bounded work: the max_tokens cap, a generation's gate, the stall
watchdog's decision, the hang fault's parsing and the request's deadline field."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import cast

import pytest
from pydantic import ValidationError

from residency.errors import ApiError
from residency.messages import Kind, Request
from residency.settings import ModelSpec
from web.faults import parse_faults
from web.pipeline import COMPLETION_DEFAULT_TOKENS, capped_params
from workers.agent import Child, stalled
from workers.gate import Gate, Reason, Stopped


@pytest.mark.parametrize(
    ("kind", "asked", "cap", "expected"),
    [
        (Kind.CHAT, None, 5, 5),  # no max_tokens: the cap
        (Kind.CHAT, 1000, 5, 5),  # clamped, not refused
        (Kind.CHAT, 3, 5, 3),
        (Kind.COMPLETION, None, 512, COMPLETION_DEFAULT_TOKENS),  # OpenAI's default
        (Kind.COMPLETION, None, 5, 5),  # ...bounded by the cap
        (Kind.COMPLETION, 100, 50, 50),
    ],
)
def test_max_tokens_is_capped(kind: Kind, asked: int | None, cap: int, expected: int) -> None:
    params = {"messages": []} if asked is None else {"messages": [], "max_tokens": asked}
    out = capped_params(kind, params, cap)
    assert out["max_tokens"] == expected
    assert params.get("max_tokens") == asked  # the caller's dict is not changed


def test_embeddings_get_no_max_tokens() -> None:
    assert capped_params(Kind.EMBEDDING, {"input": ["x"]}, 5) == {"input": ["x"]}


def test_the_cap_defaults_to_the_context_and_is_local_only() -> None:
    assert ModelSpec(path="/m.gguf", n_ctx=512).token_cap == 512
    assert ModelSpec(path="/m.gguf", n_ctx=512, max_tokens=64).token_cap == 64
    with pytest.raises(ValidationError, match="local models only"):
        ModelSpec(base_url="http://10.0.0.1/v1", max_tokens=64)
    with pytest.raises(ValidationError):
        ModelSpec(path="/m.gguf", max_tokens=0)


def test_a_gate_stops_on_cancel_deadline_and_stop_and_counts_steps() -> None:
    g = Gate("r1")
    g.step()
    g.step()
    assert g.steps == 2
    g.cancelled.set()
    with pytest.raises(Stopped) as e:
        g.step()
    assert e.value.reason is Reason.CANCELLED

    with pytest.raises(Stopped) as e:
        Gate("r2", deadline=time.time() - 1).step()
    assert e.value.reason is Reason.DEADLINE
    assert not Gate("r3", deadline=time.time() + 3600).expired()
    assert not Gate("r4").expired()  # 0: no deadline

    stop = threading.Event()
    g = Gate("r5", stop=stop)
    g.step()
    stop.set()
    with pytest.raises(Stopped) as e:
        g.step()
    assert e.value.reason is Reason.SHUTDOWN


def _child() -> Child:
    return Child("a", "t1", "cpu", cast(subprocess.Popen[bytes], None))


def test_the_watchdog_counts_from_when_it_first_sees_a_busy_model() -> None:
    c = _child()
    # Idle for ages with an old progress value: never a stall.
    assert not stalled(c, False, "100.0", 2, now=1000.0)
    # Busy: the clock starts now, not at the old progress value.
    assert not stalled(c, True, "100.0", 2, now=1000.0)
    assert not stalled(c, True, "100.0", 2, now=1001.9)
    assert stalled(c, True, "100.0", 2, now=1002.0)


def test_any_new_progress_value_restarts_the_watchdog_and_expiry_does_not() -> None:
    c = _child()
    assert not stalled(c, True, "1", 2, now=0.5)
    assert not stalled(c, True, "2", 2, now=2.0)  # progress
    assert not stalled(c, True, None, 2, now=3.9)  # the key expired: not progress
    assert stalled(c, True, None, 2, now=4.0)


def test_the_watchdog_resets_when_idle_and_can_be_off() -> None:
    c = _child()
    assert not stalled(c, True, "1", 2, now=0.0)
    assert not stalled(c, False, "1", 2, now=1.5)  # finished: reset
    assert not stalled(c, True, "1", 2, now=3.0)  # busy again: counts from here
    assert not stalled(c, True, "1", 2, now=4.9)
    assert stalled(c, True, "1", 2, now=5.0)
    off = _child()
    assert not stalled(off, True, "1", 0, now=0.0)
    assert not stalled(off, True, "1", 0, now=1e9)


def test_a_killed_or_stopping_child_is_not_judged_again() -> None:
    c = _child()
    c.stalled = ApiError(500, "x")
    assert not stalled(c, True, "1", 1, now=0.0) and not stalled(c, True, "1", 1, now=10.0)
    c = _child()
    c.stop_sent_at = 1.0
    assert not stalled(c, True, "1", 1, now=0.0) and not stalled(c, True, "1", 1, now=10.0)


def test_the_hang_fault_is_per_model_and_clearable() -> None:
    assert parse_faults({"hang": {"a": True}}) == ({"hang:a": "1"}, [])
    assert parse_faults({"hang": {"a": False}}) == ({}, ["hang:a"])
    with pytest.raises(ApiError, match="boolean"):
        parse_faults({"hang": {"a": 1}})


def test_a_request_carries_its_deadline() -> None:
    req = Request("id", Kind.CHAT, "a", {}, False, 100.0, deadline=160.0)
    assert Request.loads(req.dumps()).deadline == 160.0
    # Queued by an older web: no deadline.
    old = req.dumps().replace(',"deadline":160.0', "")
    assert Request.loads(old).deadline == 0.0
