"""Images sent by http(s) URL, through the whole box: real Redis, real model processes (a tiny
vision model with its tiny projector, llama.cpp), requests over a real HTTP server, the image
served by another on loopback.

Web fetches a local model's image URLs before the request is queued, under the guard the remote
forwarder uses: loopback is refused until ``images.allow_local_urls`` allows it, and then the
model reads the same image it reads from a data URL. Refusals name the part and cost nothing
downstream (no fetch for too many images, nor for a model that cannot see). A remote model's
request is forwarded whole: its URLs are its upstream's to fetch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import requests

from residency import registry
from residency.settings import STORED, ModelSpec
from tests.conftest import Pool, tiny_models
from tests.fixtures.images import data_url, png
from tests.integration.test_bounded_work import http_server
from tests.integration.test_reasoning_api import Upstream
from tests.integration.test_vision import vision_files

ADMIN = {"Authorization": "Bearer test-admin-key"}
IMAGE = png(64, 48, seed=5)
URL_PARAM = "messages[0].content[1].image_url.url"


class Pictures:
    """Serves ``IMAGE`` at any path and counts what it was asked."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(IMAGE)))
                self.end_headers()
                self.wfile.write(IMAGE)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def url(self, name: str = "pic.png") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@dataclass
class Box:
    pool: Pool
    base: str
    openai: openai.OpenAI
    anthropic: anthropic.Anthropic
    pictures: Pictures
    upstream: Upstream

    def configure(self, **images: Any) -> None:
        resp = requests.patch(
            f"{self.base}/admin/config", json={"images": images}, headers=ADMIN, timeout=30
        )
        assert resp.status_code == 200, resp.text


@pytest.fixture
def box(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[Box]:
    """``v``: a tiny vision model; ``a``: a text model; ``up``: a remote model."""
    model, proj = vision_files(models_dir)
    models = tiny_models(models_dir)
    models["v"] = {"path": str(model), "mmproj": str(proj), "n_ctx": 1024, "parallel": 1}
    pool = start_pool(models=models, server={"allow_local_remotes": True})
    pictures, upstream = Pictures(), Upstream()
    spec = ModelSpec.model_validate({"base_url": upstream.url}, context={STORED: True})
    registry.put(pool.r, registry.Entry("up", spec, "admin"), "test")
    try:
        with http_server(pool) as port:
            base = f"http://127.0.0.1:{port}"
            yield Box(
                pool,
                base,
                openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120),
                anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120),
                pictures,
                upstream,
            )
    finally:
        pictures.close()
        upstream.close()


def ask(*urls: str) -> Any:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]


def refused(call: Callable[[], Any]) -> Any:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value


def test_an_image_url_is_fetched_under_the_guard_and_read_as_its_data_would_be(box: Box) -> None:
    chat = box.openai.chat.completions
    url = box.pictures.url()
    # Loopback is inside the box's network: refused by default, in each API, naming the part.
    e = refused(lambda: chat.create(model="v", messages=ask(url), max_tokens=2))
    assert (e.param, e.code) == (URL_PARAM, "image_url_refused")
    assert "images.allow_local_urls" in e.message
    responses_input: Any = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "what?"},
                {"type": "input_image", "image_url": url},
            ],
        }
    ]
    e = refused(lambda: box.openai.responses.create(model="v", input=responses_input))
    assert (e.param, e.code) == (URL_PARAM, "image_url_refused")
    block: Any = {"type": "image", "source": {"type": "url", "url": url}}
    with pytest.raises(anthropic.BadRequestError) as ae:
        box.anthropic.messages.create(
            model="v",
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "text", "text": "?"}, block]}],
        )
    assert ae.value.body["error"]["message"].startswith(
        URL_PARAM.replace("[", ".").replace("]", "")
    )
    assert box.pictures.hits == []  # nothing was fetched

    box.configure(allow_local_urls=True)
    fetched = chat.create(model="v", messages=ask(url), max_tokens=2)
    assert box.pictures.hits == ["/pic.png"]
    # The model read the same image as from its data URL: the same prompt.
    inline = chat.create(model="v", messages=ask(data_url(IMAGE)), max_tokens=2)
    assert fetched.usage is not None and inline.usage is not None
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    r = box.openai.responses.create(model="v", input=responses_input, max_output_tokens=2)
    assert r.usage is not None and r.usage.input_tokens > 0
    msg = box.anthropic.messages.create(
        model="v",
        max_tokens=2,
        messages=[{"role": "user", "content": [{"type": "text", "text": "?"}, block]}],
    )
    assert msg.usage.input_tokens > 0
    assert box.pictures.hits == ["/pic.png"] * 3


def test_refusals_cost_no_fetch(box: Box) -> None:
    box.configure(allow_local_urls=True, max_per_request=2)
    chat = box.openai.chat.completions
    urls = [box.pictures.url(f"{i}.png") for i in range(3)]
    e = refused(lambda: chat.create(model="v", messages=ask(*urls), max_tokens=2))
    assert (e.param, e.code) == ("messages[0].content[3]", "too_many_images")
    # A model that cannot see refuses the image before anything is fetched for it.
    e = refused(lambda: chat.create(model="a", messages=ask(urls[0]), max_tokens=2))
    assert e.code == "model_not_multimodal"
    e = refused(lambda: chat.create(model="v", messages=ask("file:///etc/passwd"), max_tokens=2))
    assert (e.param, e.code) == (URL_PARAM, "invalid_image_url")
    assert box.pictures.hits == []
    assert box.pool.state("a") == "unloaded"  # nor was a model loaded or a prompt queued


def test_a_remote_models_image_urls_are_forwarded_whole(box: Box) -> None:
    # Past every local cap and to an address the box would not fetch: the upstream's to judge.
    box.configure(max_per_request=1)
    urls = [box.pictures.url(f"{i}.png") for i in range(3)]
    box.openai.chat.completions.create(model="up", messages=ask(*urls))
    sent = box.upstream.bodies[-1]["messages"][0]["content"]
    assert [p["image_url"]["url"] for p in sent[1:]] == urls
    assert box.pictures.hits == []
