"""Ollama's API end to end: the official ``ollama`` Python client against a real box (a real
Redis, real model processes running llama.cpp on tiny GGUFs, the web app on a real socket).
Answers are scripted token by token through the real engine (the ``script_text`` fault), so
what the client reads back is known: the text, the reasoning, a tool call.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ollama
import pytest
import requests

from residency import keys
from residency.tinymodel import write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.fixtures.images import png
from tests.integration.reasoning_templates import THINK_TEMPLATE, THINK_TOKENS
from tests.integration.test_bounded_work import http_server
from tests.integration.test_fault_script import ADMIN, CALL, WEATHER
from tests.integration.test_vision import vision_files
from tests.integration.tools_template import TOOLS_TEMPLATE

USER = [{"role": "user", "content": "Say hello."}]
IMAGE = png(32, 24, seed=5)


@dataclass
class Box:
    pool: Pool
    base: str
    client: ollama.Client

    def script(self, **texts: Any) -> None:
        resp = requests.post(
            f"{self.base}/admin/faults", json={"script_text": texts}, headers=ADMIN, timeout=30
        )
        assert resp.status_code == 200, resp.text


@pytest.fixture
def box(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[Box]:
    """``a``: plain ChatML; ``t``: takes tools; ``think``: reasons in <think>; ``v``: has a
    vision projector; ``emb``: an embedding model."""
    tools, think = models_dir / "tiny-tools.gguf", models_dir / "tiny-think.gguf"
    if not tools.exists():
        write_tiny_model(tools, seed=5, chat_template=TOOLS_TEMPLATE)
    if not think.exists():
        write_tiny_model(think, seed=21, chat_template=THINK_TEMPLATE, control_tokens=THINK_TOKENS)
    model, proj = vision_files(models_dir)
    models = tiny_models(models_dir)
    models["t"] = {"path": str(tools), "n_ctx": 2048, "parallel": 1}
    models["think"] = {"path": str(think), "n_ctx": 1024, "parallel": 1}
    models["v"] = {"path": str(model), "mmproj": str(proj), "n_ctx": 1024, "parallel": 1}
    pool = start_pool(models=models, debug={"fault_injection": True}, pool={"max_loaded_models": 3})
    with http_server(pool) as port:
        base = f"http://127.0.0.1:{port}"
        yield Box(pool, base, ollama.Client(host=base, timeout=120))


def test_chat_whole_and_streamed(box: Box) -> None:
    box.script(a=["Hello there!", "Hello there!"])
    whole = box.client.chat(model="a", messages=USER, stream=False, options={"num_predict": 50})
    assert whole.message.role == "assistant" and whole.message.content == "Hello there!"
    assert whole.done is True and whole.done_reason == "stop"
    assert whole.eval_count and whole.eval_count > 0
    assert whole.prompt_eval_count and whole.prompt_eval_count > 0
    assert whole.total_duration and whole.total_duration > 0
    for field in ("load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(whole, field), int)

    parts = list(box.client.chat(model="a", messages=USER, stream=True))
    assert "".join(p.message.content or "" for p in parts) == "Hello there!"
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == whole.eval_count
    assert parts[-1].prompt_eval_count == whole.prompt_eval_count


def test_stream_is_the_default_and_ndjson(box: Box) -> None:
    box.script(a=["Hi."])
    resp = requests.post(
        f"{box.base}/api/chat", json={"model": "a", "messages": USER}, stream=True, timeout=60
    )
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in resp.iter_lines() if x]
    assert lines[-1]["done"] is True and len(lines) >= 2


def test_generate_whole_streamed_and_raw(box: Box) -> None:
    box.script(a=["Blue.", "Blue.", "Sky"])
    whole = box.client.generate(model="a", prompt="Sky colour?", system="Be short.", stream=False)
    assert whole.response == "Blue." and whole.done and whole.done_reason == "stop"
    parts = list(box.client.generate(model="a", prompt="Sky colour?", stream=True))
    assert "".join(p.response for p in parts) == "Blue." and parts[-1].done
    raw = box.client.generate(model="a", prompt="The sky is", raw=True, stream=False)
    assert raw.response == "Sky"
    # What does not map is refused by name.
    for field, value in (("suffix", "end"), ("template", "{{ .Prompt }}"), ("context", [1, 2])):
        with pytest.raises(ollama.ResponseError) as e:
            box.client.generate(model="a", prompt="x", stream=False, **{field: value})
        assert e.value.status_code == 400 and f"'{field}'" in e.value.error


def test_options_map_and_ignored_ones_are_named(box: Box) -> None:
    box.script(a=["one two three four five six"])
    resp = requests.post(
        f"{box.base}/api/chat",
        json={
            "model": "a",
            "messages": USER,
            "stream": False,
            "keep_alive": "5m",
            "options": {"num_predict": 2, "num_ctx": 8192, "temperature": 0.1, "seed": 1},
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["eval_count"] == 2 and out["done_reason"] == "length"
    ignored = resp.headers["x-residency-ignored"]
    assert "options.num_ctx" in ignored and "keep_alive" in ignored
    bad = requests.post(
        f"{box.base}/api/chat",
        json={"model": "a", "messages": USER, "stream": False, "options": {"temperature": 9}},
        timeout=60,
    )
    assert bad.status_code == 400 and "options.temperature" in bad.json()["error"]


def test_format_json(box: Box) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    box.script(a=['{"n": 7}', '{"n": 7}'])
    out = box.client.chat(model="a", messages=USER, format="json", stream=False)
    assert json.loads(out.message.content or "") == {"n": 7}
    out = box.client.chat(model="a", messages=USER, format=schema, stream=False)
    assert json.loads(out.message.content or "") == {"n": 7}


def test_tools_round_trip_whole_and_streamed(box: Box) -> None:
    box.script(t=[CALL, CALL, "It is sunny in Oslo."])
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    out = box.client.chat(model="t", messages=ask, tools=[WEATHER], stream=False)
    calls = out.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    parts = list(box.client.chat(model="t", messages=ask, tools=[WEATHER], stream=True))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        ("get_weather", {"city": "Oslo"})
    ]
    # The call and its result go back as Ollama sends them: arguments an object, a tool message.
    history = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "content": '{"sky": "sunny"}', "tool_name": "get_weather"},
    ]
    final = box.client.chat(model="t", messages=history, tools=[WEATHER], stream=False)
    assert final.message.content == "It is sunny in Oslo."


def test_think_whole_and_streamed(box: Box) -> None:
    text = "<think>\nThey greet me.\n</think>\n\nHello!"
    box.script(think=[text, text, text])
    out = box.client.chat(model="think", messages=USER, think=True, stream=False)
    assert out.message.thinking == "They greet me." and out.message.content == "Hello!"
    parts = list(box.client.chat(model="think", messages=USER, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "They greet me."
    assert "".join(p.message.content or "" for p in parts) == "Hello!"
    gen = box.client.generate(model="think", prompt="Hi", think="low", stream=False)
    assert gen.thinking == "They greet me." and gen.response == "Hello!"


def test_images_on_a_vision_model_and_refused_on_another(box: Box) -> None:
    b64 = base64.b64encode(IMAGE).decode()
    seen = {"role": "user", "content": "What is this?", "images": [b64]}
    out = box.client.chat(model="v", messages=[seen], stream=False, options={"num_predict": 2})
    plain = box.client.chat(
        model="v", messages=[{"role": "user", "content": "What is this?"}], stream=False,
        options={"num_predict": 2},
    )  # fmt: skip
    assert (out.prompt_eval_count or 0) > (plain.prompt_eval_count or 0)
    gen = box.client.generate(model="v", prompt="What?", images=[IMAGE], stream=False,
                              options={"num_predict": 2})  # fmt: skip
    assert gen.done
    with pytest.raises(ollama.ResponseError) as e:
        box.client.chat(model="a", messages=[seen], stream=False)
    assert e.value.status_code == 400 and "'a'" in e.value.error


def test_embed_and_legacy_embeddings(box: Box) -> None:
    out = box.client.embed(model="emb", input=["one", "two"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) > 0
    single = box.client.embed(model="emb", input="one")
    # A batch of two and one input alone embed "one" alike (float32 sums in another order).
    assert single.embeddings[0] == pytest.approx(out.embeddings[0], abs=1e-5)
    legacy = box.client.embeddings(model="emb", prompt="one")
    assert list(legacy.embedding) == single.embeddings[0]
    with pytest.raises(ollama.ResponseError) as e:
        box.client.embed(model="a", input="x")
    assert e.value.status_code == 400


def test_tags_show_ps_version(box: Box) -> None:
    names = {m.model for m in box.client.list().models}
    assert {"a", "t", "think", "v", "emb"} <= names
    tag = next(m for m in box.client.list().models if m.model == "a")
    assert tag.details is not None and tag.details.format == "gguf" and (tag.size or 0) > 0
    assert "tools" in (box.client.show("t").capabilities or [])
    assert "vision" in (box.client.show("v").capabilities or [])
    assert "thinking" in (box.client.show("think").capabilities or [])
    assert box.client.show("emb").capabilities == ["embedding"]
    shown = box.client.show("a")
    assert shown.modelinfo and "general.architecture" in shown.modelinfo
    box.script(a=["Hi."])
    box.client.chat(model="a", messages=USER, stream=False)
    running = {m.model: m for m in box.client.ps().models}
    assert "a" in running and (running["a"].size or 0) > 0
    assert requests.get(f"{box.base}/api/version", timeout=10).json()["version"]


def test_errors_are_ollamas_shape(box: Box) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        box.client.chat(model="nope", messages=USER, stream=False)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        box.client.chat(model="nope", messages=USER, stream=True).__next__()
    assert e.value.status_code == 404
    resp = requests.post(f"{box.base}/api/chat", json={"model": "a", "think": "max"}, timeout=10)
    assert resp.status_code == 400 and set(resp.json()) == {"error"}
    # Pulls write a host's disk: the admin token's only (tests/integration/test_pulls.py).
    pull = requests.post(f"{box.base}/api/pull", json={"model": "x"}, timeout=10)
    assert pull.status_code == 403 and set(pull.json()) == {"error"}


def _unloads(box: Box) -> list[dict[str, Any]]:
    records = [json.loads(str(x)) for x in box.pool.r.lrange(keys.audit(), 0, -1)]
    return [x for x in records if x["action"] == "model.unload"]


def test_keep_alive_zero_unloads_for_the_admin_only(box: Box) -> None:
    box.script(a=["Hi.", "Hi."])
    resp = requests.post(
        f"{box.base}/api/chat",
        json={"model": "a", "messages": USER, "stream": False, "keep_alive": 0},
        timeout=60,
    )
    # A caller without the admin token: the model, which others may be using, stays.
    assert resp.status_code == 200 and "keep_alive" in resp.headers["x-residency-ignored"]
    assert _unloads(box) == []
    admin = ollama.Client(host=box.base, timeout=120, headers=ADMIN)
    admin.chat(model="a", messages=USER, stream=False, keep_alive=0)
    assert [x["detail"] for x in _unloads(box)] == [{"name": "a", "via": "keep_alive"}]
    deadline = time.monotonic() + 60
    while box.pool.r.hget(keys.model("a"), "state") != "unloaded":
        assert time.monotonic() < deadline, "the admin's keep_alive 0 did not unload the model"
        time.sleep(0.05)
    # Ollama's unload idiom: no messages, nothing generated.
    out = admin.chat(model="b", messages=[], keep_alive=0)
    assert out.done_reason == "unload"


@pytest.fixture
def keyed(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[tuple[str, str]]:
    """A box that requires keys, and a key that may use ``a`` only, one request a minute."""
    pool = start_pool(models=tiny_models(models_dir), auth={"required": True})
    with http_server(pool) as port:
        base = f"http://127.0.0.1:{port}"
        r = requests.post(f"{base}/admin/users", json={"name": "u"}, headers=ADMIN, timeout=10)
        assert r.status_code == 201, r.text
        scopes = {"models": ["a"], "quotas": {"requests_per_minute": 1}}
        r = requests.post(f"{base}/admin/users/u/keys", json=scopes, headers=ADMIN, timeout=10)
        assert r.status_code == 201, r.text
        yield base, str(r.json()["key"])


def test_a_keys_scopes_and_quotas_apply(keyed: tuple[str, str]) -> None:
    base, key = keyed
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=base).chat(model="a", messages=USER, stream=False)
    assert e.value.status_code == 401
    client = ollama.Client(host=base, headers={"Authorization": f"Bearer {key}"})
    assert [m.model for m in client.list().models] == ["a"]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="b", messages=USER, stream=False)
    assert e.value.status_code == 403 and "'b'" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.show("b")
    assert e.value.status_code == 403
    client.chat(model="a", messages=USER, stream=False, options={"num_predict": 1})
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="a", messages=USER, stream=False, options={"num_predict": 1})
    assert e.value.status_code == 429
