"""An image for a model that cannot see is the client's 400 naming the model, through every
API that takes images (chat ``image_url`` parts, Anthropic ``image`` blocks, Responses
``input_image``), against real model processes (llama.cpp, tiny text GGUF): never an answer
from the text with the images dropped, and no tokens charged for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from residency import keys
from tests.conftest import Pool
from tests.integration.test_pool import client_for
from tests.integration.test_usage import usage_of

PNG = "iVBORw0KGgo="  # the PNG signature: the bytes are never decoded
IMAGE_URL: Any = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}


def refused_naming_a(resp: Any) -> dict[str, Any]:
    assert resp.status_code == 400, resp.get_data(as_text=True)
    body = resp.get_json()
    err = body["error"]
    assert err["type"] == "invalid_request_error"
    assert "model 'a'" in err["message"] and "image" in err["message"]
    return dict(err)


def test_an_image_for_a_text_model_is_refused_naming_it(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool()
    c = client_for(pool)
    messages = [
        {"role": "system", "content": "look"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE_URL]},
    ]
    for stream in (False, True):
        resp = c.post(
            "/v1/chat/completions",
            json={"model": "a", "messages": messages, "max_tokens": 4, "stream": stream},
        )
        err = refused_naming_a(resp)
        assert err["param"] == "messages[1].content[1]"
        assert err["code"] == "model_not_multimodal"

    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    anthropic = {
        "model": "a",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, block]}],
    }
    resp = c.post("/v1/messages", json=anthropic)
    assert resp.status_code == 400
    err = resp.get_json()["error"]
    assert err["type"] == "invalid_request_error" and "model 'a'" in err["message"]
    del anthropic["max_tokens"]
    resp = c.post("/v1/messages/count_tokens", json=anthropic)
    assert resp.status_code == 400 and "model 'a'" in resp.get_json()["error"]["message"]
    url = {"type": "image", "source": {"type": "url", "url": "https://example.invalid/x.png"}}
    anthropic = {"model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": [url]}]}
    resp = c.post("/v1/messages", json=anthropic)
    assert resp.status_code == 400 and "model 'a'" in resp.get_json()["error"]["message"]

    responses = {
        "model": "a",
        "max_output_tokens": 16,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what?"},
                    {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"},
                ],
            }
        ],
    }
    refused_naming_a(c.post("/v1/responses", json=responses))

    # Web refused them once it knew the model: nothing was loaded, queued, prompted or
    # generated for any of them.
    assert pool.r.hget(keys.model("a"), "state") in (None, "unloaded")
    assert usage_of(pool.r, keys.ANONYMOUS, "a") == {}
    # The model still answers text.
    resp = c.post(
        "/v1/chat/completions",
        json={"model": "a", "messages": [messages[1] | {"content": "hi"}], "max_tokens": 2},
    )
    assert resp.status_code == 200, resp.get_json()
    assert usage_of(pool.r, keys.ANONYMOUS, "a")["requests"] == 1
