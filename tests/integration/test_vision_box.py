"""Images through the whole box: real Redis, real model processes running llama.cpp with a tiny
model and its tiny projector, requests through the official ``openai`` and ``anthropic``
clients over a real HTTP server.

A vision model answers an image in each API's own shape (chat ``image_url``, Responses
``input_image``, Messages ``image`` blocks); a model without a projector refuses one naming
itself; a policy's ``has_images`` rule sends images to the vision candidate; the projector's
bytes count toward the model's memory; and four slots serve an image beside three streams.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import requests

from residency import ledger
from residency.settings import ModelSpec
from residency.tinyprojector import IMAGE_TOKENS
from tests.conftest import Pool, tiny_models
from tests.fixtures.images import data_url, png
from tests.integration.test_bounded_work import http_server
from tests.integration.test_vision import vision_files

IMAGE = png(64, 48, seed=3)
POLICY = {
    "candidates": ["a", "v"],
    "default": "a",
    "rules": [{"id": "images", "match": {"has_images": True}, "route_to": "v"}],
}


@dataclass
class Box:
    pool: Pool
    base: str
    client: openai.OpenAI


@pytest.fixture
def box(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[Box]:
    model, proj = vision_files(models_dir)
    models = tiny_models(models_dir)
    models["v"] = {"path": str(model), "mmproj": str(proj), "n_ctx": 1024, "parallel": 4}
    pool = start_pool(
        models=models,
        pool={"max_loaded_models": 2},
        policies={"auto": POLICY},
        debug={"fault_injection": True},
    )
    with http_server(pool) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield Box(pool, base, client)


def ask(text: str = "what is in the picture?") -> list[dict[str, Any]]:
    parts = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
    ]
    return [{"role": "user", "content": parts}]


def test_a_vision_model_answers_an_image_and_a_text_model_refuses_it(box: Box) -> None:
    out = box.client.chat.completions.create(model="v", messages=ask(), max_tokens=4)  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.completion_tokens == 4
    text_only = box.client.chat.completions.create(
        model="v", messages=[{"role": "user", "content": "what is in the picture?"}], max_tokens=1
    )
    assert text_only.usage is not None
    # The image's positions are in the prompt (the text around it is the same).
    assert out.usage.prompt_tokens - text_only.usage.prompt_tokens >= IMAGE_TOKENS
    with pytest.raises(openai.BadRequestError) as e:
        box.client.chat.completions.create(model="a", messages=ask(), max_tokens=4)  # type: ignore[arg-type]
    assert "'a'" in str(e.value) and "image" in str(e.value)


def test_each_api_takes_an_image_in_its_own_shape(box: Box) -> None:
    b64 = base64.b64encode(IMAGE).decode()
    msg = anthropic.Anthropic(base_url=box.base, api_key="unused", max_retries=0).messages.create(
        model="v",
        max_tokens=3,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": b64},
                    },
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ],
    )
    assert msg.usage.input_tokens > IMAGE_TOKENS and msg.usage.output_tokens == 3
    resp = box.client.responses.create(
        model="v",
        max_output_tokens=16,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": data_url(IMAGE), "detail": "auto"},
                ],
            }
        ],
    )
    assert resp.usage is not None and resp.usage.input_tokens > IMAGE_TOKENS
    counted = requests.post(
        f"{box.base}/v1/messages/count_tokens",
        json={
            "model": "v",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": b64},
                        },
                        {"type": "text", "text": "what is this?"},
                    ],
                }
            ],
        },
        timeout=60,
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == msg.usage.input_tokens


def test_a_has_images_rule_sends_an_image_to_the_vision_candidate(box: Box) -> None:
    raw = box.client.chat.completions.with_raw_response.create(
        model="auto",
        messages=ask(),
        max_tokens=2,  # type: ignore[arg-type]
    )
    assert raw.headers["x-residency-route"] == "auto:images:v"
    assert raw.parse().usage is not None
    raw = box.client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert raw.headers["x-residency-route"] == "auto:default:a"


def test_the_projector_counts_toward_the_models_memory(box: Box, models_dir: Path) -> None:
    model, proj = vision_files(models_dir)
    with_proj = ModelSpec(path=str(model), mmproj=str(proj), n_ctx=1024, parallel=4)
    without = ModelSpec(path=str(model), n_ctx=1024, parallel=4)
    a, b = ledger.estimated(with_proj, "cpu"), ledger.estimated(without, "cpu")
    assert a is not None and b is not None
    assert a - b == proj.stat().st_size
    # A measured footprint of one says nothing about the other.
    assert ledger.digest(with_proj, "cpu") != ledger.digest(without, "cpu")


def test_four_slots_serve_an_image_beside_three_streams(box: Box) -> None:
    results: dict[str, Any] = {}
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        started.wait()
        text = ""
        for chunk in box.client.chat.completions.create(
            model="v",
            messages=[{"role": "user", "content": f"tell me story {i}"}],
            max_tokens=60,
            stream=True,
        ):
            for choice in chunk.choices:
                text += choice.delta.content or ""
        results[f"s{i}"] = text

    def image() -> None:
        started.wait()
        out = box.client.chat.completions.create(model="v", messages=ask(), max_tokens=8)  # type: ignore[arg-type]
        results["image"] = out

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=image))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(results) == {"s0", "s1", "s2", "image"}
    assert results["image"].usage.completion_tokens == 8
    assert all(results[f"s{i}"] for i in range(3))


def test_an_admin_registered_projector_must_lie_in_the_model_directories(
    box: Box, models_dir: Path, tmp_path: Path
) -> None:
    model, proj = vision_files(models_dir)
    admin = {"Authorization": "Bearer test-admin-key"}
    outside = tmp_path / "elsewhere-mmproj.gguf"
    outside.write_bytes(proj.read_bytes())
    url = f"{box.base}/admin/models/eye"
    missing = str(models_dir / "missing.gguf")
    for mmproj, code in ((str(outside), "path_not_allowed"), (missing, "path_not_found")):
        body = {"path": str(model), "mmproj": mmproj, "n_ctx": 512}
        resp = requests.put(url, json=body, headers=admin, timeout=30)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "mmproj"
        assert resp.json()["error"]["code"] == code
    body = {"path": str(model), "mmproj": str(proj), "n_ctx": 512}
    resp = requests.put(url, json=body, headers=admin, timeout=30)
    assert resp.status_code == 201, resp.text
    assert resp.json()["model"]["mmproj"] == str(proj.resolve())
    out = box.client.chat.completions.create(model="eye", messages=ask(), max_tokens=2)  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.prompt_tokens > IMAGE_TOKENS


def test_an_image_reserves_its_bound_not_its_bytes_of_a_users_daily_tokens(box: Box) -> None:
    admin = {"Authorization": "Bearer test-admin-key"}
    resp = requests.post(
        f"{box.base}/admin/users",
        json={"name": "pia", "quotas": {"tokens_per_day": 20_000}},
        headers=admin,
        timeout=30,
    )
    assert resp.status_code == 201, resp.text
    resp = requests.post(f"{box.base}/admin/users/pia/keys", json={}, headers=admin, timeout=30)
    key = {"Authorization": f"Bearer {resp.json()['key']}"}
    photo = png(320, 240, seed=9)  # ~230 KB: as text, the day's 20,000 tokens ten times over
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": data_url(photo)}},
            ],
        }
    ]
    faults = f"{box.base}/admin/faults"
    assert requests.post(faults, json={"hold": {"v": True}}, headers=admin, timeout=30).ok
    answer: dict[str, Any] = {}

    def image() -> None:
        body = {"model": "v", "messages": messages, "max_tokens": 2}
        answer["r"] = requests.post(
            f"{box.base}/v1/chat/completions", json=body, headers=key, timeout=120
        )

    held = threading.Thread(target=image)
    held.start()
    try:
        deadline = time.monotonic() + 60
        while not any(
            m["name"] == "v" and m["in_flight"] == 1
            for m in requests.get(f"{box.base}/health", headers=admin, timeout=30).json()["models"]
        ):
            assert time.monotonic() < deadline, "the image request never got in flight"
            time.sleep(0.05)
        # While the image is in flight, what it reserved leaves the day room for another
        # request: its bound, not its bytes.
        text = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        other = requests.post(
            f"{box.base}/v1/chat/completions", json=text, headers=key, timeout=120
        )
        assert other.status_code == 200, other.text
    finally:
        requests.post(faults, json={"hold": {"v": False}}, headers=admin, timeout=30)
        held.join(120)
    assert answer["r"].status_code == 200, answer["r"].text
    # What it used is charged: the image's positions, not its bytes.
    assert IMAGE_TOKENS < answer["r"].json()["usage"]["total_tokens"] < 1000
