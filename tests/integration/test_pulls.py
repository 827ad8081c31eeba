"""Pulls (``POST /admin/pulls``, ``residency pull``) on a real box from a local server that
answers as the Hugging Face hub does (``HF_ENDPOINT`` points at it): the model lands in the
data dir and is registered and served; a dropped connection is resumed with Range; a wrong
checksum, a full disk and a cancel leave nothing behind."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import ollama
import pytest
import requests

from residency import keys
from residency.tinymodel import write_tiny_model
from tests.conftest import Pool
from tests.integration.test_bounded_work import http_server
from tests.integration.test_pool import ADMIN

REPO = "org/tiny-GGUF"
REV = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """The hub endpoints ``HfApi.model_info(files_metadata=True)`` and a file download use:
    ``/api/models/REPO[/revision/REV]`` and ``/REPO/resolve/REV/FILE`` (with Range)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.sha: dict[str, str] = {}  # advertised checksum overrides (a wrong one)
        self.drop_once: set[str] = set()  # files whose first download stops halfway
        self.gate: dict[str, threading.Event] = {}  # files that wait halfway until set
        self.halfway = threading.Event()
        self.ranges: list[str | None] = []  # the Range header of each file GET
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _json(self, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                api = f"/api/models/{REPO}"
                if path in (api, f"{api}/revision/main"):
                    return self._json(hub.info())
                prefix = f"/{REPO}/resolve/"
                if not path.startswith(prefix):
                    self.send_error(404)
                    return None
                name = path[len(prefix) :].split("/", 1)[1]
                data = hub.files.get(name)
                if data is None:
                    self.send_error(404)
                    return None
                start = 0
                rng = self.headers.get("Range")
                if body:
                    hub.ranges.append(rng)
                if rng:
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if not body:
                    return None
                rest = data[start:]
                half = len(rest) // 2
                if name in hub.drop_once:
                    hub.drop_once.discard(name)
                    self.wfile.write(rest[:half])
                    self.wfile.flush()
                    self.close_connection = True
                    return None
                gate = hub.gate.get(name)
                if gate is not None:
                    self.wfile.write(rest[:half])
                    self.wfile.flush()
                    hub.halfway.set()
                    gate.wait(30)
                    rest = rest[half:]
                self.wfile.write(rest)
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def info(self) -> dict[str, Any]:
        return {
            "id": REPO,
            "sha": REV,
            "siblings": [
                {
                    "rfilename": name,
                    "size": len(data),
                    "blobId": "0" * 40,
                    "lfs": {
                        "size": len(data),
                        "sha256": self.sha.get(name) or hashlib.sha256(data).hexdigest(),
                        "pointerSize": 134,
                    },
                }
                for name, data in self.files.items()
            ],
        }

    def close(self) -> None:
        for g in self.gate.values():
            g.set()
        self.server.shutdown()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    h = FakeHub()
    src = tmp_path / "src"
    src.mkdir()
    h.files["tiny-Q8_0.gguf"] = write_tiny_model(src / "a.gguf", seed=11, dtype="q8_0").read_bytes()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield h
    h.close()


def _pull(port: int, **body: Any) -> requests.Response:
    return requests.post(
        f"http://127.0.0.1:{port}/admin/pulls", json=body, headers=ADMIN, timeout=30
    )


def _wait(pool: Pool, port: int, pull_id: str, states: set[str]) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def done() -> bool:
        got.update(
            requests.get(
                f"http://127.0.0.1:{port}/admin/pulls/{pull_id}", headers=ADMIN, timeout=10
            ).json()
        )
        return got["state"] in states

    pool.wait_for(done, timeout=60, what=f"pull {pull_id} in {states}")
    return got


def _leftovers(pool: Pool) -> list[str]:
    d = pool.box.models_dir
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_a_pull_registers_the_model_and_it_answers(
    start_pool: Callable[..., Pool], hub: FakeHub
) -> None:
    pool = start_pool()
    with http_server(pool) as port:
        resp = _pull(port, source=f"hf:{REPO}")
        assert resp.status_code == 202, resp.text
        p = _wait(pool, port, resp.json()["id"], {"done", "failed", "cancelled"})
        assert p["state"] == "done", p
        size = len(hub.files["tiny-Q8_0.gguf"])
        assert p["bytes_done"] == p["bytes_total"] == size
        assert p["model"] == "tiny-Q8_0"
        assert hub.ranges == [None]  # one whole download
        model = requests.get(
            f"http://127.0.0.1:{port}/admin/models/tiny-Q8_0", headers=ADMIN, timeout=10
        ).json()
        assert model["source"] == "admin" and model["type"] == "llm"
        assert model["n_ctx"] == 2048  # its trained context, under the 4096 cap
        assert model["path"] == str(pool.box.models_dir / "tiny-Q8_0.gguf")
        assert _leftovers(pool) == ["tiny-Q8_0.gguf"]
        health = requests.get(f"http://127.0.0.1:{port}/health", headers=ADMIN, timeout=10).json()
        assert [x["id"] for x in health["pulls"]] == [p["id"]]
        assert health["pulls"][0]["state"] == "done"
        chat = requests.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": "tiny-Q8_0",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            timeout=120,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 3
        # The same name again is refused before anything is fetched.
        again = _pull(port, source=f"hf:{REPO}")
        assert again.status_code == 409 and again.json()["error"]["code"] == "name_taken"


def test_an_interrupted_download_resumes_with_range(
    start_pool: Callable[..., Pool], hub: FakeHub
) -> None:
    pool = start_pool()
    hub.drop_once.add("tiny-Q8_0.gguf")
    size = len(hub.files["tiny-Q8_0.gguf"])
    with http_server(pool) as port:
        resp = _pull(port, source=f"hf:{REPO}:Q8_0", name="resumed")
        p = _wait(pool, port, resp.json()["id"], {"done", "failed", "cancelled"})
        assert p["state"] == "done", p
        assert hub.ranges == [None, f"bytes={size // 2}-"]
        assert pool.r.hexists(keys.registry(), "resumed")
        assert _leftovers(pool) == ["tiny-Q8_0.gguf"]


def test_a_wrong_checksum_registers_nothing_and_leaves_no_file(
    start_pool: Callable[..., Pool], hub: FakeHub
) -> None:
    pool = start_pool()
    hub.sha["tiny-Q8_0.gguf"] = "ab" * 32
    with http_server(pool) as port:
        resp = _pull(port, source=f"hf:{REPO}", name="bad")
        p = _wait(pool, port, resp.json()["id"], {"done", "failed", "cancelled"})
        assert p["state"] == "failed" and "sha256" in p["error"], p
        assert not pool.r.hexists(keys.registry(), "bad")
        assert _leftovers(pool) == []


def test_a_full_disk_is_refused_before_the_download(
    start_pool: Callable[..., Pool], hub: FakeHub
) -> None:
    pool = start_pool()
    pool.agent.puller.free_bytes = lambda _folder: 1000
    with http_server(pool) as port:
        resp = _pull(port, source=f"hf:{REPO}", name="big")
        p = _wait(pool, port, resp.json()["id"], {"done", "failed", "cancelled"})
        assert p["state"] == "failed" and "not enough disk space" in p["error"], p
        assert hub.ranges == []  # nothing was fetched
        assert not pool.r.hexists(keys.registry(), "big")
        assert _leftovers(pool) == []


def test_a_cancel_stops_the_download_and_removes_the_partial_file(
    start_pool: Callable[..., Pool], hub: FakeHub
) -> None:
    pool = start_pool()
    hub.gate["tiny-Q8_0.gguf"] = threading.Event()
    with http_server(pool) as port:
        cfg = requests.patch(
            f"http://127.0.0.1:{port}/admin/config",
            json={"pulls": {"max_queued": 1}},
            headers=ADMIN,
            timeout=10,
        )
        assert cfg.status_code == 200, cfg.text
        resp = _pull(port, source=f"hf:{REPO}", name="stopped")
        pull_id = resp.json()["id"]
        assert hub.halfway.wait(30)
        pool.wait_for(
            lambda: int(pool.r.hget(keys.pull(pull_id), "bytes_done") or 0) > 0,
            what="first bytes reported",
        )
        parts = _leftovers(pool)
        assert parts == [".tiny-Q8_0.gguf.part"]
        # A second pull to the same name is refused while this one runs (409), not after its
        # download; the host's queue holds one pull (pulls.max_queued = 1): another is refused.
        same = _pull(port, source=f"hf:{REPO}", name="stopped")
        assert same.status_code == 409 and "pull under way" in same.json()["error"]["message"]
        full = _pull(port, source=f"hf:{REPO}", name="second")
        assert full.status_code == 429 and full.json()["error"]["code"] == "pull_queue_full"
        stop = requests.delete(
            f"http://127.0.0.1:{port}/admin/pulls/{pull_id}", headers=ADMIN, timeout=10
        )
        assert stop.status_code == 202
        hub.gate["tiny-Q8_0.gguf"].set()
        p = _wait(pool, port, pull_id, {"done", "failed", "cancelled"})
        assert p["state"] == "cancelled", p
        assert not pool.r.hexists(keys.registry(), "stopped")
        assert _leftovers(pool) == []


def test_a_repo_with_several_ggufs_needs_a_choice(
    start_pool: Callable[..., Pool], hub: FakeHub
) -> None:
    pool = start_pool()
    hub.files["tiny-F16.gguf"] = b"GGUF"
    with http_server(pool) as port:
        resp = _pull(port, source=f"hf:{REPO}")
        assert resp.status_code == 400
        assert resp.json()["choices"] == ["tiny-F16.gguf", "tiny-Q8_0.gguf"]
        assert _pull(port, source=f"hf:{REPO}:Q4_K_M").status_code == 400
        assert _pull(port, source="ftp://x/y.gguf").status_code == 400
        assert _pull(port, source=f"hf:{REPO}", host="nohost").status_code == 400


def test_the_cli_pulls_with_a_progress_bar(
    start_pool: Callable[..., Pool], hub: FakeHub, tmp_path: Path
) -> None:
    pool = start_pool()
    with http_server(pool) as port:
        env = {
            "PATH": "/usr/bin:/bin",
            "RESIDENCY_ADMIN_KEY": "test-admin-key",
            "RESIDENCY_DATA_DIR": str(tmp_path / "cli"),
        }
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "residency.cli",
                "pull",
                f"hf:{REPO}",
                "--name",
                "viacli",
                "--url",
                f"http://127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert res.returncode == 0, res.stderr
        assert "100%" in res.stderr and "done" in res.stderr
        assert json.loads(res.stdout)["model"] == "viacli"
        assert pool.r.hexists(keys.registry(), "viacli")


def test_ollamas_pull_streams_a_pull_for_the_admin_only(
    start_pool: Callable[..., Pool], hub: FakeHub
) -> None:
    pool = start_pool()
    with http_server(pool) as port:
        base = f"http://127.0.0.1:{port}"
        admin = ollama.Client(host=base, headers=ADMIN)
        lines = list(admin.pull(f"hf.co/{REPO}:Q8_0", stream=True))
        statuses = [line.status for line in lines]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
        size = len(hub.files["tiny-Q8_0.gguf"])
        done = [line for line in lines if line.completed is not None]
        assert done and done[-1].completed == done[-1].total == size
        assert [m.model for m in admin.list().models if m.model == "tiny-Q8_0"] == ["tiny-Q8_0"]
        # Its library's names are not pulled from; a user (no admin token) may not pull.
        with pytest.raises(ollama.ResponseError) as e:
            admin.pull("llama3.2:1b", stream=False)
        assert e.value.status_code == 400 and "hf.co/" in e.value.error
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=base).pull(f"hf.co/{REPO}:Q8_0", stream=False)
        assert e.value.status_code == 403
        assert _leftovers(pool) == ["tiny-Q8_0.gguf"]
