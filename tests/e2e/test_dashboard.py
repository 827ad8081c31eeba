"""The admin dashboard in a real browser: `residency up` with a tiny model loaded, /admin/ui in
headless Chromium (Debian's `chromium` and `chromium-driver`, driven by selenium): sign in with
the admin key, see the resident model, change `pool.max_loaded_models` in the config form and
see it applied (on the page after a refresh, and in GET /admin/config); a bad value is refused
with the API's error next to the field it names; signing out forgets the key.

Outside CI a missing browser skips this test; in CI (CI=true) it fails: scripts/test.sh installs
the browser. Every wait polls a state; the bound only stops a broken test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import OPEN_AUTH, tiny_models, write_config

pytestmark = pytest.mark.e2e

BOUND_S = 120.0  # bounds a broken test only


def _missing(what: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} (scripts/test.sh installs chromium and chromium-driver as root)")
    pytest.skip(what)


def _browser() -> tuple[str, str]:
    """Paths of the browser and its driver, or a skip (a failure in CI)."""
    browser = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        _missing("no chromium and chromedriver on PATH (Debian: chromium, chromium-driver)")
    assert browser is not None and driver is not None
    try:
        import selenium  # noqa: F401
    except ImportError:
        _missing("selenium is not installed (pip install -e '.[test]')")
    return browser, driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Up:
    """`residency up` (gunicorn, coordinator, agent, embedded Redis) with models a and b."""

    def __init__(self, tmp: Path, models_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data = tmp / "data"
        models = tiny_models(models_dir)
        cfg = write_config(
            tmp / "box.toml",
            {
                "server": {"port": self.port, "web_workers": 1},
                "auth": OPEN_AUTH,
                "pool": {"max_loaded_models": 1},
                "models": {"a": models["a"], "b": models["b"]},
            },
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
        self.log = tmp / "up.log"
        with self.log.open("wb") as out:
            args = ["up", "--config", str(cfg), "--data-dir", str(data)]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "residency.cli", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for(lambda: "residency is up" in self.log.read_text(errors="replace"), "the box")
        self.key = (data / "admin.key").read_text().strip()
        self.admin = {"Authorization": f"Bearer {self.key}"}

    def get(self, path: str) -> Any:
        resp = requests.get(self.url + path, headers=self.admin, timeout=30)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def state(self, model: str) -> str:
        return str(next(m["state"] for m in self.get("/health")["models"] if m["name"] == model))


@pytest.fixture
def up(tmp_path: Path, models_dir: Path) -> Iterator[Up]:
    box = Up(tmp_path, models_dir)
    yield box
    box.proc.send_signal(signal.SIGTERM)
    try:
        box.proc.wait(60)
    except subprocess.TimeoutExpired:
        box.proc.kill()
        box.proc.wait(10)


@pytest.fixture
def browser() -> Iterator[Any]:
    binary, driver_path = _browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1000",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Both paths given: selenium never looks for (or downloads) a driver.
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    yield drv
    drv.quit()


def _text(drv: Any, css: str) -> str:
    """The text of the first element ``css`` selects ('' when there is none yet)."""
    script = "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';"
    return str(drv.execute_script(script, css))


# The browser first: a missing one skips (or fails) before a box is started.
def test_dashboard_shows_the_pool_and_edits_the_config(browser: Any, up: Up) -> None:
    from selenium.webdriver.common.by import By

    drv = browser
    resp = requests.post(up.url + "/admin/models/a/load", headers=up.admin, timeout=30)
    assert resp.status_code == 202, resp.text
    wait_for(lambda: up.state("a") == "ready", "a ready")
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    resp = requests.post(up.url + "/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 200, resp.text
    # A policy choosing among a (resident) and b (cold, listed first): it takes a.
    policy = {"candidates": ["a", "b"], "default": ["b", "a"], "choose": "fastest"}
    resp = requests.put(up.url + "/admin/policies/auto", json=policy, headers=up.admin, timeout=30)
    assert resp.status_code == 201, resp.text
    routed = {**chat, "model": "auto"}
    resp = requests.post(up.url + "/v1/chat/completions", json=routed, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-residency-route"].startswith("auto:default:a; fastest; ")

    drv.get(up.url + "/admin/ui")
    # A wrong key is refused and not kept.
    drv.find_element(By.ID, "token").send_keys("not-the-key")
    drv.find_element(By.ID, "sign-in").click()
    wait_for(lambda: "refused" in _text(drv, "#sign-in-error"), "the refusal")
    assert drv.execute_script("return sessionStorage.length") == 0

    token = drv.find_element(By.ID, "token")
    token.clear()
    token.send_keys(up.key)
    drv.find_element(By.ID, "sign-in").click()

    # The pool: a is resident and ready, b is not loaded; the limits show 1 configured.
    wait_for(lambda: _text(drv, 'tr[data-model="a"] [data-field="state"]') == "ready", "a row")
    assert _text(drv, 'tr[data-model="b"] [data-field="state"]') == "unloaded"
    assert not drv.find_element(By.ID, "sign-in-form").is_displayed()
    assert _text(drv, 'tr[data-model="a"] [data-field="where"]').endswith("/ cpu")
    assert _text(drv, 'tr[data-type="llm"] [data-field="configured"]') == "1"
    # Usage: the day of that request has its bar (or, on a box without the usage API, the
    # section says so).
    usage = requests.get(up.url + "/admin/usage", headers=up.admin, timeout=30)
    if usage.status_code == 404:
        wait_for(lambda: "not available" in _text(drv, "#usage-status"), "no usage")
    else:
        assert usage.status_code == 200, usage.text
        [day] = [d for d, t in usage.json()["days"].items() if t["requests"]]
        bar = f'#usage-chart g[data-day="{day}"] title'
        wait_for(lambda: "requests 2," in _text(drv, bar), "the usage bar")  # a, then auto
    wait_for(lambda: _text(drv, '#loads tr[data-model="a"] [data-field="ok"]') == "1", "a load")
    # The policy's choices and its measured predictions (the coordinator sums them every 10 s).
    row = '#routing tr[data-policy="auto"]'
    wait_for(lambda: _text(drv, f'{row} [data-field="choices"]') == "a 1", "the routing row")
    assert _text(drv, f'{row} [data-field="samples"]') == "1"
    assert _text(drv, f'{row} [data-field="error"]').endswith(" s)")

    # Change the limit in the form and save.
    field = drv.find_element(By.ID, "setting-pool.max_loaded_models")
    assert field.get_attribute("value") == "1"
    field.clear()
    field.send_keys("2")
    drv.find_element(By.ID, "save-config").click()
    wait_for(lambda: _text(drv, "#config-message").startswith("Saved"), "the save")
    assert "pool.max_loaded_models" in _text(drv, "#config-message")

    # Applied: the API returns it, and the page shows it after its refreshes (the form, the
    # setting's source, and the limit the coordinator now publishes in /health).
    assert up.get("/admin/config")["config"]["pool"]["max_loaded_models"] == 2
    wait_for(
        lambda: _text(drv, 'tr[data-type="llm"] [data-field="configured"]') == "2",
        "the new limit on the page",
    )
    wait_for(lambda: field.get_attribute("value") == "2", "the new value in the form")
    assert _text(drv, "#source-pool\\.max_loaded_models") == "admin"

    # A value the API refuses: its error is shown next to the field it names; nothing changed.
    queue = drv.find_element(By.ID, "setting-pool.max_queue_per_model")
    queue.clear()
    queue.send_keys("0")
    drv.find_element(By.ID, "save-config").click()
    wait_for(lambda: _text(drv, "#config-message").startswith("Not saved"), "the refusal")
    assert "pool.max_queue_per_model" in _text(drv, "#config-message")
    assert _text(drv, "#error-pool\\.max_queue_per_model") != ""
    assert queue.get_attribute("aria-invalid") == "true"
    assert up.get("/admin/config")["config"]["pool"]["max_queue_per_model"] == 64

    # No script errors (a 404 for a missing optional endpoint is not one) and no blocked
    # resource (the page's Content-Security-Policy allows this origin only).
    severe = [
        e["message"]
        for e in drv.get_log("browser")
        if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]
    ]
    assert severe == []

    # Signing out forgets the key and hides the dashboard.
    drv.find_element(By.ID, "sign-out").click()
    assert drv.execute_script("return sessionStorage.length") == 0
    assert not drv.find_element(By.ID, "dashboard").is_displayed()
    assert drv.find_element(By.ID, "token").is_displayed()
