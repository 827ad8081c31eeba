"""Shared fixtures: a real Redis server (the embedded one `residency up` uses), tiny GGUF models
written by `residency.tinymodel`, and a running pool (coordinator and agent in threads of the
test process; the model processes they start are real subprocesses running llama.cpp)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from residency import keys
from residency.box import Box, connect
from residency.redis_server import EmbeddedRedis
from residency.tinymodel import write_tiny_model


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False)
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = connect(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    for i in range(3):
        write_tiny_model(d / f"tiny{i}.gguf", seed=i)
    write_tiny_model(d / "tiny-q8.gguf", seed=7, dtype="q8_0")
    write_tiny_model(d / "tiny-embed.gguf", seed=3, embedding=True)
    return d


#: ``[auth]`` of a test box whose test is not about auth: keyless API calls, /health and
#: /metrics open (keys are required by default).
OPEN_AUTH: dict[str, Any] = {"required": False, "public_health": True}
#: The same as environment variables, for tests that build a ``Box`` without a config file.
OPEN_AUTH_ENV = {"RESIDENCY_AUTH_REQUIRED": "false", "RESIDENCY_AUTH_PUBLIC_HEALTH": "true"}


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return str(v)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines: list[str] = []
    for section, values in sections.items():
        if section in ("models", "policies"):
            for name, spec in values.items():
                lines.append(f'[{section}."{name}"]')
                lines += [f"{k} = {toml_value(v)}" for k, v in spec.items()]
        else:
            lines.append(f"[{section}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_models(models_dir: Path, **extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Registry entries for the tiny models: a, b, c (chat), q8 (q8_0 chat), emb (embedding).
    The chat models have one slot: the pool tests hold one request to keep a model busy and
    queue the next behind it. The slot tests (test_slots.py) give their models several."""
    out: dict[str, dict[str, Any]] = {
        "a": {"path": str(models_dir / "tiny0.gguf"), "n_ctx": 512, "parallel": 1},
        "b": {"path": str(models_dir / "tiny1.gguf"), "n_ctx": 512, "parallel": 1},
        "c": {"path": str(models_dir / "tiny2.gguf"), "n_ctx": 512, "parallel": 1},
        "q8": {"path": str(models_dir / "tiny-q8.gguf"), "n_ctx": 512, "parallel": 1},
        "emb": {"path": str(models_dir / "tiny-embed.gguf"), "n_ctx": 512, "type": "embedding"},
    }
    for name, spec in extra.items():
        out[name] = {**out.get(name, {}), **spec}
    return out


@dataclass
class Pool:
    """A running box without the HTTP server: coordinator + agent threads on a real Redis."""

    box: Box
    r: redis.Redis
    coordinator: Any
    agent: Any
    stop: threading.Event
    threads: list[threading.Thread]

    def wait_for(self, pred: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
        """Poll a condition on real state; the timeout only bounds a broken test."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what or pred}")

    def state(self, model: str) -> str:
        return str(self.r.hget(keys.model(model), "state") or "unloaded")

    def pid(self, model: str) -> int | None:
        v = self.r.hget(keys.model(model), "pid")
        return int(str(v)) if v else None

    def resident(self) -> set[str]:
        out = set()
        for k in self.r.scan_iter(match=keys.model_pattern()):
            if self.r.hget(k, "state") in ("loading", "ready", "draining"):
                out.add(str(k).removeprefix(keys.model("")))
        return out


@pytest.fixture
def start_pool(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> Iterator[Callable[..., Pool]]:
    from coordinator.loop import Coordinator
    from workers.agent import Agent

    started: list[Pool] = []

    def _start(
        pool: dict[str, Any] | None = None,
        models: dict[str, dict[str, Any]] | None = None,
        debug: dict[str, Any] | None = None,
        server: dict[str, Any] | None = None,
        policies: dict[str, dict[str, Any]] | None = None,
        worker: dict[str, Any] | None = None,
        auth: dict[str, Any] | None = None,
        cache: dict[str, Any] | None = None,
    ) -> Pool:
        cfg = write_config(
            tmp_path / "config.toml",
            {
                "server": {"model_dirs": [str(models_dir)], **(server or {})},
                "pool": pool or {},
                "debug": debug or {},
                "models": models if models is not None else tiny_models(models_dir),
                "policies": policies or {},
                "worker": worker or {},
                # Keys are required by default; the pool tests are not about auth (test_auth.py
                # is), so their boxes take keyless requests unless a test says otherwise.
                "auth": auth if auth is not None else OPEN_AUTH,
                "cache": cache or {},
            },
        )
        box = Box(
            data_dir=tmp_path / "data",
            config_path=cfg,
            redis_url=redis_url,
            environ={"RESIDENCY_ADMIN_KEY": "test-admin-key"},
        )
        stop = threading.Event()
        coord = Coordinator(box, connect(redis_url), stop=stop)
        agent = Agent(box, connect(redis_url), host="testhost", device_list=["cpu"], stop=stop)
        threads = [
            threading.Thread(target=coord.run, name="coordinator", daemon=True),
            threading.Thread(target=agent.run, name="agent", daemon=True),
        ]
        for t in threads:
            t.start()
        p = Pool(box, r, coord, agent, stop, threads)
        p.wait_for(lambda: r.hexists(keys.health(), "record"), what="first health record")
        started.append(p)
        return p

    yield _start
    for p in started:
        p.stop.set()
        for t in p.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in p.threads), "a role thread outlived its stop"
