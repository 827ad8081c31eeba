"""A model's reasoning kept apart from its answer, through each API over a real HTTP server, with
the official ``openai`` and ``anthropic`` clients.

Two sources of chat answers that reason: a remote model (an OpenAI-compatible upstream on
loopback that answers with ``reasoning_content``, whole and streamed, and records what it was
sent), and a real model process (llama.cpp, a tiny model whose chat template renders
``<think>`` blocks) made to write ``<think>why</think>answer`` by the ``script_text`` fault,
which the model process splits. Either way chat passes the reasoning through, Messages answers
a ``thinking`` block before the text, Responses a ``reasoning`` item before the message, and the
reasoning is never in the answer's text. The requests' efforts (``reasoning_effort``,
``reasoning.effort``, ``thinking``) reach the model, and reasoning sent back in a history reaches
its prompt.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import redis
import requests
from flask import Flask, Response, jsonify, request
from werkzeug.serving import make_server

from residency.box import Box
from residency.tinymodel import write_tiny_model
from tests.conftest import OPEN_AUTH_ENV, Pool, tiny_models
from tests.integration.test_bounded_work import http_server
from tests.integration.test_remote_hardening import register
from web import create_app

ADMIN = {"Authorization": "Bearer test-admin-key"}
THOUGHT = "The user greets me."
ANSWER = "Hello!"
USAGE = {
    "prompt_tokens": 5,
    "completion_tokens": 9,
    "total_tokens": 14,
    "completion_tokens_details": {"reasoning_tokens": 6},
}
HI: Any = [{"role": "user", "content": "hi"}]

#: ChatML that renders an assistant turn's reasoning in a ``<think>`` block before its answer,
#: as Qwen3's template does: the model process reads its markers from it.
THINK_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and message.reasoning_content is defined "
    "and message.reasoning_content -%}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# --- a remote model that reasons --------------------------------------------------------------


class Upstream:
    """An OpenAI-compatible server whose model reasons; it records each request's body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        app = Flask("upstream")

        @app.post("/v1/chat/completions")
        def chat() -> Any:
            body = request.get_json()
            self.bodies.append(body)
            if body.get("stream"):
                return Response(self._stream(body), mimetype="text/event-stream")
            message = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return jsonify({**self._head("chat.completion"), "choices": [choice], "usage": USAGE})

        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def _head(kind: str) -> dict[str, Any]:
        return {"id": "up-1", "object": kind, "created": 1, "model": "upstream-model"}

    def _stream(self, body: dict[str, Any]) -> Iterator[str]:
        head = self._head("chat.completion.chunk")
        deltas = [
            {"role": "assistant", "content": ""},
            {"reasoning_content": "The user "},
            {"reasoning_content": "greets me."},
            {"content": "Hel"},
            {"content": "lo!"},
        ]
        for d in deltas:
            yield f"data: {json.dumps({**head, 'choices': [{'index': 0, 'delta': d}]})}\n\n"
        done = {"index": 0, "delta": {}, "finish_reason": "stop"}
        yield f"data: {json.dumps({**head, 'choices': [done]})}\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': USAGE})}\n\n"
        yield "data: [DONE]\n\n"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join(10)


@dataclass
class Remote:
    upstream: Upstream
    base: str
    openai: openai.OpenAI
    anthropic: anthropic.Anthropic


@pytest.fixture
def remote(tmp_path: Path, redis_url: str, r: redis.Redis) -> Iterator[Remote]:
    """A box (web only) with the remote model ``up``, served on a real socket."""
    upstream = Upstream()
    register(r, "up", upstream.url)
    env = {
        **OPEN_AUTH_ENV,
        "RESIDENCY_ADMIN_KEY": "test-admin-key",
        "RESIDENCY_SERVER_ALLOW_LOCAL_REMOTES": "true",
    }
    box = Box(data_dir=tmp_path, config_path=None, redis_url=redis_url, environ=env)
    srv = make_server("127.0.0.1", 0, create_app(box), threaded=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{srv.server_port}"
    try:
        yield Remote(
            upstream,
            base,
            openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60),
        )
    finally:
        srv.shutdown()
        t.join(10)
        upstream.close()


def test_a_remote_models_reasoning_passes_through_chat_and_its_effort_reaches_it(
    remote: Remote,
) -> None:
    out = remote.openai.chat.completions.create(model="up", messages=HI, reasoning_effort="low")
    message = out.choices[0].message
    assert message.content == ANSWER
    assert (message.model_extra or {}).get("reasoning_content") == THOUGHT
    assert out.usage is not None and out.usage.completion_tokens_details is not None
    assert out.usage.completion_tokens_details.reasoning_tokens == 6
    assert remote.upstream.bodies[-1]["reasoning_effort"] == "low"

    reasoning, content = "", ""
    for c in remote.openai.chat.completions.create(model="up", messages=HI, stream=True):
        for choice in c.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)
    # History: an assistant turn's reasoning goes on to the upstream as it came.
    history = [*HI, {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}, *HI]
    remote.openai.chat.completions.create(model="up", messages=history)
    assert remote.upstream.bodies[-1]["messages"][1]["reasoning_content"] == THOUGHT


def test_a_remote_models_reasoning_is_a_thinking_block_in_messages(remote: Remote) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 8000}
    msg = remote.anthropic.messages.create(
        model="up", max_tokens=64, messages=HI, thinking=thinking
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    first, second = msg.content
    assert first.type == "thinking" and first.thinking == THOUGHT and first.signature == ""
    assert second.type == "text" and second.text == ANSWER
    assert remote.upstream.bodies[-1]["reasoning_effort"] == "medium"

    with remote.anthropic.messages.stream(model="up", max_tokens=64, messages=HI) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "thinking" in kinds and "signature" in kinds  # the SDK's own names of those deltas
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    assert "reasoning_effort" not in remote.upstream.bodies[-1]  # no thinking asked: nothing

    # The thinking block sent back is the upstream's reasoning_content of that turn.
    turn: Any = {"role": "assistant", "content": [b.model_dump() for b in msg.content]}
    remote.anthropic.messages.create(
        model="up", max_tokens=8, messages=[*HI, turn, *HI], thinking={"type": "disabled"}
    )
    sent = remote.upstream.bodies[-1]
    assert sent["messages"][1] == {
        "role": "assistant",
        "content": ANSWER,
        "reasoning_content": THOUGHT,
    }
    assert sent["reasoning_effort"] == "none"


def test_a_remote_models_reasoning_is_a_reasoning_item_in_responses(remote: Remote) -> None:
    r = remote.openai.responses.create(model="up", input="hi", reasoning={"effort": "high"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.type == "reasoning" and item.content is not None
    assert [c.text for c in item.content] == [THOUGHT] and item.summary == []
    assert r.output_text == ANSWER
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == 6
    assert r.reasoning is not None and r.reasoning.effort == "high"
    assert remote.upstream.bodies[-1]["reasoning_effort"] == "high"

    with remote.openai.responses.stream(model="up", input="hi") as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds.count("response.reasoning_text.delta") == 2
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == ANSWER
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 6

    # The output items sent back as they came: the reasoning is the assistant turn's.
    items = [o.model_dump(exclude_none=True) for o in r.output]
    remote.openai.responses.create(
        model="up",
        input=[{"role": "user", "content": "hi"}, *items, {"role": "user", "content": "and?"}],
    )
    sent = remote.upstream.bodies[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["reasoning_content"] == THOUGHT


# --- a local model that reasons (the model process splits its text) ---------------------------


@dataclass
class Local:
    pool: Pool
    base: str
    openai: openai.OpenAI
    anthropic: anthropic.Anthropic

    def script(self, *texts: str) -> None:
        resp = requests.post(
            f"{self.base}/admin/faults",
            json={"script_text": {"r": list(texts)}},
            headers=ADMIN,
            timeout=30,
        )
        assert resp.status_code == 200, resp.text


@pytest.fixture
def local(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[Local]:
    """``r``: a tiny model whose template renders ``<think>`` blocks (its reasoning markers,
    read from the template: ``reasoning = "auto"``)."""
    # A file of its own: the session's models dir is shared, and other tests' thinking models
    # (tiny-think.gguf) have templates that do not render an earlier turn's reasoning.
    path = models_dir / "tiny-think-history.gguf"
    if not path.exists():
        write_tiny_model(path, seed=9, chat_template=THINK_TEMPLATE)
    models = tiny_models(models_dir)
    models["r"] = {"path": str(path), "n_ctx": 512, "parallel": 1}
    pool = start_pool(models=models, debug={"fault_injection": True})
    with http_server(pool) as port:
        base = f"http://127.0.0.1:{port}"
        yield Local(
            pool,
            base,
            openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120),
        )


SCRIPT = "<think>why</think>answer"


def test_a_local_models_reasoning_in_chat_whole_and_streamed(local: Local) -> None:
    local.script(SCRIPT, SCRIPT)
    out = local.openai.chat.completions.create(
        model="r", messages=HI, max_tokens=64, reasoning_effort="low"
    )
    message = out.choices[0].message
    assert message.content == "answer"
    assert (message.model_extra or {}).get("reasoning_content") == "why"
    assert out.usage is not None and out.usage.completion_tokens_details is not None
    assert 0 < out.usage.completion_tokens_details.reasoning_tokens < out.usage.completion_tokens

    reasoning, content, usage = "", "", None
    for c in local.openai.chat.completions.create(
        model="r", messages=HI, max_tokens=64, stream=True, stream_options={"include_usage": True}
    ):
        usage = c.usage or usage
        for choice in c.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("why", "answer")
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens > 0

    # History: an assistant turn's reasoning reaches the template, which renders it.
    def prompt_tokens(turn: dict[str, Any]) -> int:
        got = local.openai.chat.completions.create(
            model="r",
            messages=[*HI, turn, *HI],
            max_tokens=1,  # type: ignore[list-item]
        )
        assert got.usage is not None
        return got.usage.prompt_tokens

    plain = prompt_tokens({"role": "assistant", "content": "answer"})
    thought = "because the question asks for it " * 3
    with_reasoning = {"role": "assistant", "content": "answer", "reasoning_content": thought}
    assert prompt_tokens(with_reasoning) > plain + 10


def test_a_local_models_reasoning_in_messages_whole_and_streamed(local: Local) -> None:
    local.script(SCRIPT, SCRIPT)
    msg = local.anthropic.messages.create(
        model="r", max_tokens=64, messages=HI, thinking={"type": "enabled", "budget_tokens": 2048}
    )
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content
    ] == [
        ("thinking", "why"),
        ("text", "answer"),
    ]
    with local.anthropic.messages.stream(model="r", max_tokens=64, messages=HI) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    # History: thinking blocks sent back reach the template (count_tokens renders the prompt).
    turn: Any = {"role": "assistant", "content": [b.model_dump() for b in msg.content]}
    text_only: Any = {"role": "assistant", "content": [{"type": "text", "text": "answer"}]}
    counted = [
        local.anthropic.messages.count_tokens(model="r", messages=[*HI, t, *HI]).input_tokens
        for t in (turn, text_only)
    ]
    assert counted[0] > counted[1]


def test_a_local_models_reasoning_in_responses_whole_and_streamed(local: Local) -> None:
    local.script(SCRIPT, SCRIPT)
    r = local.openai.responses.create(
        model="r", input="hi", max_output_tokens=64, reasoning={"effort": "medium"}
    )
    assert [o.type for o in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.type == "reasoning" and item.content is not None
    assert [c.text for c in item.content] == ["why"]
    assert r.output_text == "answer"
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens > 0
    with local.openai.responses.stream(model="r", input="hi", max_output_tokens=64) as s:
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == "answer"
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0
