"""Grammar work is bounded and costs only its own request, on real llama.cpp (the tiny GGUF):

* the engine samples first and checks the token against the grammar, applying the grammar to
  the whole vocabulary only when it refuses the token (counted by a wrapper around the real
  backend, same interface);
* beside a request whose grammar is costly, another request gets a token in every engine step
  while the costly one ends on its budget;
* through the HTTP API, a schema whose pattern is costly to enforce (within the validation
  bound) ends alone with ``grammar_budget_exceeded`` while another client's requests on the
  same model (two slots) get all their tokens and a valid JSON answer;
* a pattern whose nested repeats multiply past the bound never reaches a model process.

The tiny vocabulary spells text mostly by single characters, so ``logit_bias`` steers what the
chain draws: toward ``a`` (which a pattern of a's allows) or toward ``b`` (which it refuses).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from residency.errors import ApiError
from residency.settings import ModelSpec
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import http_server
from workers.engine import Backend, End, Job, Sampling, Token
from workers.runtime import LlamaRuntime

# Token ids of the tiny vocabulary (residency.tinymodel): its byte tokens and their
# space-less duplicates.
A = ("102", "367")
B = ("103", "368")
QUOTE = ("39", "304")
EOS = "4"
BUDGET_S = 0.02
# Within the bound (16 x 16 = 256) but ambiguous: every a can end an inner or an outer repeat.
COSTLY = "^(a{0,16}){0,16}$"
WAIT_S = 120.0  # bounds a broken test only


def bias(up: tuple[str, ...] = (), down: tuple[str, ...] = ()) -> dict[str, int]:
    return {**dict.fromkeys(up, 100), **dict.fromkeys(down, -100)}


def string_schema(pattern: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": pattern}},
        "required": ["s"],
    }


class Counting:
    """The real backend, counting the grammar's checks of one token and its applications to
    the whole vocabulary."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.n_vocab = inner.n_vocab
        self.checks = 0
        self.applied = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def allows(self, sampler: Any, token: int) -> bool:
        self.checks += 1
        return self.inner.allows(sampler, token)

    def draw(self, sampler: Any, idx: int, grammar: bool) -> int | None:
        self.applied += grammar
        return self.inner.draw(sampler, idx, grammar)


def test_tokens_the_grammar_allows_are_taken_without_applying_it_to_the_vocabulary(
    models_dir: Path,
) -> None:
    holder: list[Counting] = []

    def wrap(b: Backend) -> Backend:
        holder.append(Counting(b))
        return holder[0]

    rt = LlamaRuntime(wrap=wrap)
    rt.load(ModelSpec(path=str(models_dir / "tiny0.gguf"), n_ctx=1024, parallel=2), "cpu")
    try:
        out = rt.chat(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 400,
                "temperature": 1.0,
                "seed": 3,
                "logit_bias": bias(up=A),
                "logprobs": True,
                "top_logprobs": 2,
                "response_format": {"type": "json_object", "schema": string_schema("^a{0,200}$")},
            },
            False,
        )
    finally:
        rt.close()
    c = holder[0]
    assert isinstance(out, dict)
    doc = json.loads(out["choices"][0]["message"]["content"])
    assert set(doc["s"]) <= {"a"} and len(doc["s"]) > 50
    n = out["usage"]["completion_tokens"]
    # One check per token; the grammar applied only where the chain's a was refused (the
    # JSON around the string, its end).
    assert c.checks == n + 1  # the end-of-generation token is checked too
    assert 0 < c.applied < 30 < n
    # Logprobs are the model's own (raw logits), whichever way the token was chosen.
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == n and all(t["logprob"] <= 0 for t in content)


def test_on_llama_cpp_the_slot_beside_a_costly_grammar_gets_a_token_every_step(
    models_dir: Path,
) -> None:
    rt = LlamaRuntime(grammar_budget_s=BUDGET_S)
    rt.load(ModelSpec(path=str(models_dir / "tiny0.gguf"), n_ctx=1024, parallel=2), "cpu")
    try:
        prompt = rt.llm.tokenize(b"a victim", add_bos=True, special=True)
        victim = rt.engine.submit(Job(prompt, 400, Sampling(temperature=0, logit_bias={4: -100})))
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.extend(drain(victim)), daemon=True)
        t.start()
        body = costly_request(stream=False)
        params = {k: body[k] for k in ("messages", "max_tokens", "temperature", "logit_bias")}
        params["response_format"] = {"type": "json_object", "schema": string_schema(COSTLY)}
        with pytest.raises(ApiError) as e:
            rt.chat(params, False)
        # It ended on its budget (after tens of tokens; the victim has 400 to generate).
        assert e.value.code == "grammar_budget_exceeded"
        assert e.value.param == "response_format"
        t.join(WAIT_S)
        steps = rt.engine.steps
    finally:
        rt.close()
    *tokens, end = got
    assert end == End("length") and len(tokens) == 400
    # The victim was in every step the engine took, the costly request's included, and got a
    # token in each: the costly grammar took no step from it.
    assert steps == 400


def drain(job: Job) -> list[Token | End]:
    out: list[Token | End] = []
    while True:
        item = job.next()
        out.append(item)
        if isinstance(item, End):
            return out


@pytest.fixture
def port(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[int]:
    models = tiny_models(models_dir, a={"parallel": 2, "n_ctx": 1024})
    pool = start_pool(models=models, worker={"grammar_budget_s": BUDGET_S})
    with http_server(pool) as p:
        yield p


def post(port: int, path: str, body: dict[str, Any], **kw: Any) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{port}/v1{path}", json=body, timeout=300, **kw)


def costly_request(stream: bool) -> dict[str, Any]:
    schema = string_schema(COSTLY)
    return {
        "model": "a",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 400,
        "temperature": 1.0,
        # The chain always wants a b, which the pattern refuses: every token applies the
        # grammar, and its string runs on (quotes pushed down).
        "logit_bias": bias(up=B, down=QUOTE),
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "stream": stream,
    }


def sse_events(resp: requests.Response) -> list[Any]:
    out: list[Any] = []
    for line in resp.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_costly_schema_ends_alone_while_another_clients_requests_on_the_model_finish(
    port: int,
) -> None:
    # The costly stream is in its slot (its first chunks came) before the other client starts.
    resp = post(port, "/chat/completions", costly_request(stream=True), stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines(decode_unicode=True)
    first = next(line for line in lines if line.startswith("data: "))
    assert "error" not in json.loads(first.removeprefix("data: "))
    rest: dict[str, Any] = {}
    t = threading.Thread(target=lambda: rest.update(events=sse_events(resp)), daemon=True)
    t.start()

    # The other client, meanwhile, on the model's other slot: plain text to the last token,
    # and a JSON answer of its own schema (a grammar within budget).
    plain = post(
        port,
        "/completions",
        {"model": "a", "prompt": "once", "max_tokens": 64, "logit_bias": bias(down=(EOS,))},
    )
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] == 64
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    ok_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    shaped = post(
        port,
        "/chat/completions",
        {
            "model": "a",
            "messages": [{"role": "user", "content": "ok?"}],
            "max_tokens": 50,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "ok", "schema": ok_schema},
            },
        },
    )
    assert shaped.status_code == 200, shaped.text
    assert isinstance(json.loads(shaped.json()["choices"][0]["message"]["content"])["ok"], bool)

    t.join(300)
    assert not t.is_alive()
    events = rest["events"]
    # The costly stream ends cleanly: its error as the last event, then [DONE].
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "grammar_budget_exceeded"
    assert err["param"] == "response_format"
    assert all("error" not in e for e in events[:-2])

    # Whole, the same request is a 400 in the OpenAI envelope.
    whole = post(port, "/chat/completions", costly_request(stream=False))
    assert whole.status_code == 400
    assert whole.json()["error"]["code"] == "grammar_budget_exceeded"
    # And the model serves on.
    again = post(port, "/completions", {"model": "a", "prompt": "x", "max_tokens": 3})
    assert again.status_code == 200


def test_a_pattern_whose_nested_repeats_multiply_past_the_bound_is_refused(port: int) -> None:
    body = costly_request(stream=False)
    schema = string_schema("^((a|b){0,100}){0,100}$")
    body["response_format"]["json_schema"]["schema"] = schema
    resp = post(port, "/chat/completions", body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "schema_too_large"
    assert err["param"] == "response_format.json_schema.schema.properties.s.pattern"
