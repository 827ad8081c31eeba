"""End to end: `residency up` as a user starts it, driven by the official `openai` client and
plain HTTP; then SIGTERM, and nothing may be left running."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import requests

from residency import supervisor
from tests.conftest import OPEN_AUTH, tiny_models, write_config

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_up(cfg: Path, data: Path, **popen: Any) -> subprocess.Popen[Any]:
    """`residency up` with this config and data dir, none of our RESIDENCY_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
    args = ["-m", "residency.cli", "up", "--config", str(cfg), "--data-dir", str(data)]
    return subprocess.Popen([sys.executable, *args], env=env, **popen)


class Up:
    def __init__(self, tmp: Path, models_dir: Path, config: str | None = None) -> None:
        """Start `residency up` with its data in ``tmp / "data"`` (reused if it exists), on the
        tiny models, or on ``config`` (a config file's text without [server]) when given."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = tmp / "data"
        if config is None:
            cfg = write_config(
                tmp / "box.toml",
                {
                    "server": {"port": self.port, "web_workers": 1, "max_request_bytes": 65536},
                    "auth": OPEN_AUTH,
                    "debug": {"fault_injection": True},
                    "models": tiny_models(models_dir),
                },
            )
        else:
            cfg = tmp / "box.toml"
            cfg.write_text(f"{config}\n[server]\nport = {self.port}\nweb_workers = 1\n")
        self.proc = start_up(
            cfg, self.data, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("residency up exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if "residency is up" in line:
                break
        else:
            raise AssertionError("residency up never became ready:\n" + "".join(self.lines))
        self.admin_key = (self.data / "admin.key").read_text().strip()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Up]:
    box = Up(tmp_path_factory.mktemp("up"), models_dir)
    yield box
    if box.proc.poll() is None:
        box.proc.send_signal(signal.SIGTERM)
        box.proc.wait(60)


def test_models_are_listed(up: Up) -> None:
    ids = {m.id for m in up.client.models.list().data}
    assert {"a", "b", "c", "q8", "emb"} <= ids


def test_chat_completion(up: Up) -> None:
    r = up.client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert r.model == "a"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens == 8


def test_streaming_chat(up: Up) -> None:
    stream = up.client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 2
    assert text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion(up: Up) -> None:
    r = up.client.completions.create(model="b", prompt="the world", max_tokens=6)
    assert r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 6


def test_embeddings_one_vector_per_input(up: Up) -> None:
    r = up.client.embeddings.create(model="emb", input=["one", "two", "three"])
    assert [d.index for d in r.data] == [0, 1, 2]
    assert all(len(d.embedding) == 64 for d in r.data)


def _error(resp: requests.Response) -> dict[str, object]:
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return dict(body["error"])


def test_bad_json_is_400_with_envelope(up: Up) -> None:
    resp = requests.post(
        up.url + "/v1/chat/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == 400
    _error(resp)


def test_unknown_model_is_404(up: Up) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        up.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"


def test_wrong_type_names_the_field(up: Up) -> None:
    resp = requests.post(
        up.url + "/v1/chat/completions",
        json={"model": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
        timeout=10,
    )
    assert resp.status_code == 400
    assert _error(resp)["param"] == "max_tokens"


def test_oversized_body_is_413(up: Up) -> None:
    big = "x" * 100_000
    resp = requests.post(
        up.url + "/v1/chat/completions",
        json={"model": "a", "messages": [{"role": "user", "content": big}]},
        timeout=10,
    )
    assert resp.status_code == 413
    _error(resp)


def test_health_and_metrics_carry_the_contract_names(up: Up) -> None:
    h = requests.get(up.url + "/health", timeout=10).json()
    for k in ("status", "version", "generation", "max_models", "llm_pool_autosize", "auto_evict"):
        assert k in h
    assert h["max_models"]["llm"] == {"configured": 1, "effective": 1}
    names = {m["name"] for m in h["models"]}
    assert {"a", "emb"} <= names
    m = next(m for m in h["models"] if m["name"] == "a")
    for k in ("type", "pool", "state", "pinned", "busy", "in_flight", "queued", "host", "device"):
        assert k in m
    assert h["workers"] and h["workers"][0]["alive"] is True
    text = requests.get(up.url + "/metrics", timeout=10).text
    for name in (
        'residency_max_loaded_models{kind="configured",type="llm"}',
        'residency_max_loaded_models{kind="effective",type="llm"}',
        "residency_loaded_models{",
        "residency_model_loads_total{",
        "residency_model_load_seconds_bucket{",
        "residency_requests_total{",
        "residency_time_to_first_token_seconds_bucket{",
        "residency_queue_depth{",
    ):
        assert name in text, name


def test_what_a_web_page_sends_is_refused_by_gunicorn(up: Up) -> None:
    """Through the real web server: a `text/plain` POST (no preflight needed), a rebinding
    page's Host and a foreign Origin get nothing, and nothing reaches a queue."""
    body = json.dumps({"model": "a", "messages": [{"role": "user", "content": "hi"}]})
    url = up.url + "/v1/chat/completions"
    plain = requests.post(url, data=body, headers={"Content-Type": "text/plain"}, timeout=30)
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
    host = requests.post(url, data=body, headers={"Host": "evil.example"}, timeout=30)
    assert host.status_code == 421 and host.json()["error"]["code"] == "misdirected_request"
    origin = {"Origin": "https://evil.example", "Content-Type": "application/json"}
    resp = requests.post(url, data=body, headers=origin, timeout=30)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "origin_not_allowed"
    assert (
        requests.get(up.url + "/livez", headers={"Host": "evil.example"}, timeout=30).status_code
        == 421
    )
    assert requests.get(up.url + "/livez", headers={"Host": "localhost"}, timeout=30).ok


def test_status_command_prints_the_pool(up: Up) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "residency.cli", "status", "--url", up.url],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "model" in out and "state" in out and "limits" in out


def test_config_set_and_get_through_the_admin_api(up: Up) -> None:
    env = {**os.environ, "RESIDENCY_ADMIN_KEY": up.admin_key}
    base = [sys.executable, "-m", "residency.cli", "config", "--url", up.url]
    subprocess.run(
        [*base, "set", "pool.max_queue_per_model=32"],
        env=env,
        check=True,
        timeout=30,
        capture_output=True,
    )
    got = subprocess.run(
        [*base, "get", "pool.max_queue_per_model"],
        env=env,
        check=True,
        timeout=30,
        capture_output=True,
        text=True,
    )
    assert json.loads(got.stdout) == 32
    bad = subprocess.run(
        [*base, "set", "pool.max_loaded_models=0"],
        env=env,
        timeout=30,
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "pool.max_loaded_models" in bad.stdout


def _counter(text: str, name: str, model: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_disconnect_stops_generation(up: Up) -> None:
    """A client that goes away mid-stream stops its generation within a few chunks (counted,
    not timed): each chunk is slowed by the fault hook so 200 would take long to finish."""
    admin = {"Authorization": f"Bearer {up.admin_key}"}
    requests.post(
        up.url + "/admin/faults", json={"token_delay_s": {"c": 0.05}}, headers=admin, timeout=10
    )
    try:
        with requests.post(
            up.url + "/v1/completions",
            json={"model": "c", "prompt": "go", "max_tokens": 200, "stream": True},
            stream=True,
            timeout=30,
        ) as resp:
            assert resp.status_code == 200
            first = next(line for line in resp.iter_lines() if line)
            assert first.startswith(b"data: ")
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            text = requests.get(up.url + "/metrics", timeout=10).text
            if _counter(text, "residency_generations_cancelled_total", "c") >= 1:
                break
            time.sleep(0.1)
        assert _counter(text, "residency_generations_cancelled_total", "c") == 1
        assert _counter(text, "residency_cancelled_chunks_total", "c") < 20
    finally:
        requests.post(
            up.url + "/admin/faults", json={"token_delay_s": {"c": 0}}, headers=admin, timeout=10
        )


def test_sigterm_leaves_no_process_behind(up: Up) -> None:
    # Make sure model processes exist, so there is something to clean up.
    up.client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    kids = up.descendants()
    assert len(kids) >= 4  # redis, coordinator, worker, web (+ gunicorn workers, model process)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    _gone, alive = psutil.wait_procs(kids, timeout=30)
    assert alive == [], [p.pid for p in alive]


def test_supervisor_crash_leaves_no_orphans_and_changes_survive(
    tmp_path: Path, models_dir: Path
) -> None:
    first = Up(tmp_path, models_dir)
    admin = {"Authorization": f"Bearer {first.admin_key}"}
    resp = requests.patch(
        first.url + "/admin/config",
        json={"pool": {"max_queue_per_model": 7}},
        headers=admin,
        timeout=10,
    )
    assert resp.status_code == 200
    first.client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    kids = first.descendants()
    first.proc.kill()  # a crash: no chance to clean up
    first.proc.wait(30)
    _gone, alive = psutil.wait_procs(kids, timeout=60)
    assert alive == [], [" ".join(p.cmdline()) for p in alive]

    second = Up(tmp_path, models_dir)  # same data dir: same Redis AOF, same admin key
    try:
        assert second.admin_key == first.admin_key
        cfg = requests.get(second.url + "/admin/config", headers=admin, timeout=10).json()
        assert cfg["config"]["pool"]["max_queue_per_model"] == 7
        assert cfg["sources"]["pool.max_queue_per_model"] == "admin"
    finally:
        second.proc.send_signal(signal.SIGTERM)
        second.proc.wait(60)


def _states(up: Up) -> dict[str, str]:
    # The admin key: the demo config opens /v1 only.
    admin = {"Authorization": f"Bearer {up.admin_key}"}
    h = requests.get(up.url + "/health", headers=admin, timeout=10).json()
    return {m["name"]: m["state"] for m in h["models"]}


def _wait_states(up: Up, want: dict[str, str]) -> dict[str, str]:
    """/health is a published snapshot: poll until it shows ``want`` (or give up after 60 s)."""
    deadline = time.monotonic() + 60
    states = _states(up)
    while time.monotonic() < deadline and any(states.get(n) != s for n, s in want.items()):
        time.sleep(0.1)
        states = _states(up)
    return states


def test_demo_config_swaps_its_two_models_and_routes_auto(tmp_path: Path, models_dir: Path) -> None:
    """The config `residency up` writes when none is given, on tiny models in place of the
    demo's: both models and the policy are served, one LLM is resident at a time (asking the
    second evicts the first), and `auto` routes by its rule; on loopback its API takes requests
    without a key (the README's tour sends none), /health still needs the admin key."""
    first, second = supervisor.DEFAULT_MODEL, supervisor.SECOND_MODEL
    text = supervisor.demo_config(
        models_dir / "tiny0.gguf", models_dir / "tiny1.gguf", open_api=True
    )
    up = Up(tmp_path, models_dir, config=text)
    try:
        ids = {m.id for m in up.client.models.list().data}
        assert {first, second, supervisor.DEFAULT_POLICY} <= ids
        for model in (first, second):
            r = up.client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
            )
            assert r.model == model and r.choices[0].message.content
        assert _wait_states(up, {first: "unloaded", second: "ready"}) == {
            first: "unloaded",
            second: "ready",
        }
        routes = []
        for prompt in ("Hello", "Tell me about Gemma"):
            resp = requests.post(
                up.url + "/v1/chat/completions",
                json={
                    "model": supervisor.DEFAULT_POLICY,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 4,
                },
                timeout=120,
            )
            assert resp.status_code == 200, resp.text
            routes.append(resp.headers["x-residency-route"])
        assert routes == [f"auto:default:{first}", f"auto:gemma:{second}"]
        assert requests.get(up.url + "/health", timeout=10).status_code == 401
    finally:
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
