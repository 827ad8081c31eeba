"""End to end: stopping `residency up` with SIGTERM (DESIGN §4 rule 8).

Each test starts its own box in its own data dir (they stop it, so the module `up` fixture of
test_up.py cannot be shared) and checks after the stop that no process of that box is left,
found two ways: the supervisor's descendants seen before the signal, and a scan of every
process for one that names the box's data dir (which also catches a child started after the
snapshot, such as a replenished standby model process)."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests.conftest import OPEN_AUTH, tiny_models, write_config
from tests.e2e.test_up import free_port, start_up

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 180.0  # two cores, possibly shared with other test runs
STOP_TIMEOUT_S = 60.0  # as test_up: the supervisor's own grace periods fit well inside
SLOW_LOAD_S = 300.0  # the injected load delay that a shutdown must not wait out


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll real state; the timeout only bounds a broken test, it is not a measurement."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


class Box:
    """`residency up` in ``tmp / "data"`` (reused when it exists). Its output goes to a file,
    not a pipe, so a chatty box can never block on a pipe that nobody reads."""

    def __init__(self, tmp: Path, models_dir: Path, run: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = tmp / "data"
        cfg = write_config(
            tmp / "box.toml",
            {
                "server": {"port": self.port, "web_workers": 1},
                "auth": OPEN_AUTH,
                "debug": {"fault_injection": True},
                "models": tiny_models(models_dir),
            },
        )
        self.log = tmp / f"up-{run}.log"
        with self.log.open("w") as out:
            self.proc = start_up(
                cfg, self.data, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        try:
            wait_for(self._up, START_TIMEOUT_S, "'residency is up'")
        except AssertionError as e:
            self.kill()
            raise AssertionError(f"{e}\nresidency up output:\n{self.output()}") from None
        self.admin_key = (self.data / "admin.key").read_text().strip()
        self.admin = {"Authorization": f"Bearer {self.admin_key}"}

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"residency up exited with {self.proc.returncode}")
        return "residency is up" in self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def health(self) -> dict[str, Any]:
        return dict(requests.get(self.url + "/health", timeout=10).json())

    def model_state(self, name: str) -> str | None:
        for m in self.health()["models"]:
            if m["name"] == name:
                return str(m["state"])
        return None

    def sigterm_and_wait(self, kids: list[psutil.Process]) -> tuple[int, float]:
        """SIGTERM the supervisor; (its exit status, seconds it took). Asserts that it exits
        within STOP_TIMEOUT_S and that no process of the box outlives it."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"supervisor still running {STOP_TIMEOUT_S:g}s after SIGTERM:\n" + self.output()
            ) from None
        took = time.monotonic() - t0
        _gone, alive = psutil.wait_procs(kids, timeout=30)
        assert alive == [], [_describe(p) for p in alive]
        left = box_processes(self.data)
        assert left == [], [_describe(p) for p in left]
        return code, took

    def kill(self) -> None:
        """Last resort for a failed test: stop the supervisor and anything it left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        for p in box_processes(self.data):
            with contextlib.suppress(psutil.Error):
                p.kill()


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid}: {' '.join(p.cmdline())}"
    except psutil.Error:
        return f"{p.pid}: (gone)"


def box_processes(data: Path) -> list[psutil.Process]:
    """Every live process of the box whose data dir is ``data``: the roles and model processes
    carry RESIDENCY_DATA_DIR, the embedded Redis names its socket under ``data``."""
    mine = str(data)
    me = os.getpid()
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid == me or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if (
                any(mine in arg for arg in p.cmdline())
                or p.environ().get("RESIDENCY_DATA_DIR") == mine
            ):
                out.append(p)
        except psutil.Error:
            continue  # gone meanwhile, or not ours to read
    return out


@pytest.fixture
def start_box(tmp_path: Path, models_dir: Path) -> Iterator[Callable[[], Box]]:
    started: list[Box] = []

    def _start() -> Box:
        box = Box(tmp_path, models_dir, run=len(started))
        started.append(box)
        return box

    yield _start
    for box in started:
        box.kill()


def test_burst_of_patches_then_sigterm_exits_clean_and_keeps_the_last_change(
    start_box: Callable[[], Box],
) -> None:
    box = start_box()
    # A resident model, so the limit changes below have something to enforce and the stop has
    # a model process to take down.
    r = requests.post(
        box.url + "/v1/completions",
        json={"model": "a", "prompt": "hi", "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200, r.text

    limits = [2, 1, 4, -1, 5]
    patches = [
        {"pool": {"max_loaded_models": limits[i % len(limits)], "max_queue_per_model": 10 + i}}
        for i in range(19)
    ]
    patches.append({"pool": {"max_loaded_models": 3, "max_queue_per_model": 29}})
    generations: list[int] = []
    for body in patches:
        resp = requests.patch(box.url + "/admin/config", json=body, headers=box.admin, timeout=30)
        assert resp.status_code == 200, resp.text
        got = resp.json()
        assert got["updated"] == {
            "pool.max_loaded_models": body["pool"]["max_loaded_models"],
            "pool.max_queue_per_model": body["pool"]["max_queue_per_model"],
        }
        generations.append(int(got["generation"]))
    assert all(a < b for a, b in itertools.pairwise(generations)), generations

    kids = box.descendants()
    assert len(kids) >= 4, [_describe(p) for p in kids]
    code, took = box.sigterm_and_wait(kids)
    assert code == 0, box.output()
    print(f"stopped in {took:.1f}s")

    again = start_box()  # same data dir: same Redis AOF, same admin key
    assert again.admin_key == box.admin_key
    cfg = requests.get(again.url + "/admin/config", headers=again.admin, timeout=10).json()
    assert cfg["config"]["pool"]["max_loaded_models"] == 3
    assert cfg["config"]["pool"]["max_queue_per_model"] == 29
    assert cfg["sources"]["pool.max_loaded_models"] == "admin"
    assert cfg["sources"]["pool.max_queue_per_model"] == "admin"
    assert cfg["generation"] >= generations[-1]
    # /health is published by the (new) coordinator: wait for its first record after the start.
    wait_for(
        lambda: again.health()["max_models"]["llm"]["configured"] == 3,
        60,
        "/health to show max_models.llm.configured == 3",
    )
    h = again.health()
    assert h["max_models"]["llm"] == {"configured": 3, "effective": 3}
    assert h["max_models"]["embedding"]["configured"] == 3
    kids = again.descendants()
    code, _took = again.sigterm_and_wait(kids)
    assert code == 0, again.output()


def test_sigterm_during_a_slow_load_stops_the_box_promptly(start_box: Callable[[], Box]) -> None:
    box = start_box()
    resp = requests.post(
        box.url + "/admin/faults",
        json={"load_delay_s": {"b": SLOW_LOAD_S}},
        headers=box.admin,
        timeout=10,
    )
    assert resp.status_code == 200, resp.text

    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            r = requests.post(
                box.url + "/v1/completions",
                json={"model": "b", "prompt": "hi", "max_tokens": 2},
                # Far above the stop bound, far below the load delay: an answer or an error
                # must come because the box stopped, and the client can never hang the test.
                timeout=(10, 120),
            )
            outcome["status"] = r.status_code
            outcome["body"] = r.text
        except requests.RequestException as e:
            outcome["error"] = e

    client = threading.Thread(target=ask, name="slow-load-client", daemon=True)
    client.start()
    wait_for(lambda: box.model_state("b") == "loading", 60, "model b to be loading")
    assert client.is_alive(), outcome  # it waits for the load

    kids = box.descendants()
    code, took = box.sigterm_and_wait(kids)  # bound: STOP_TIMEOUT_S, well under SLOW_LOAD_S
    assert code == 0, box.output()
    print(f"stopped in {took:.1f}s during a {SLOW_LOAD_S:g}s load")

    client.join(60)
    assert not client.is_alive(), "the waiting client hung after the box stopped"
    # The waiting request was withdrawn and answered, not cut off: 503 shutting_down with a
    # Retry-After, so the client knows to retry.
    assert outcome.get("status") == 503, outcome
    assert '"shutting_down"' in outcome["body"], outcome
    print(f"client got: {outcome}")

    # Nothing is left behind for a client that is gone: after a restart the box does not load
    # b for that request.
    box2 = start_box()
    b = [m for m in box2.health()["models"] if m["name"] == "b"]
    assert not b or (b[0]["state"] in ("unloaded", "failed") and b[0]["queued"] == 0), b
    code, _ = box2.sigterm_and_wait(box2.descendants())
    assert code == 0, box2.output()
