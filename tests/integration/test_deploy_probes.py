"""deploy/ against a running box: the Compose health checks of the coordinator and the workers
say what they claim on a real Redis, and every metric (and histogram bucket) that the alerts and
the Grafana panels name is in a real /metrics scrape."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import redis

from tests.conftest import Pool
from tests.integration.test_pool import ADMIN, chat, client_for
from tests.unit.test_deploy import alert_rules, compose_doc, dashboard_exprs, metric_names


def run_check(service: str, redis_url: str, **env: str) -> int:
    test = compose_doc()["services"][service]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]
    done = subprocess.run(
        [sys.executable, *test[2:]],
        env={"RESIDENCY_REDIS_URL": redis_url, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode


def test_health_checks_follow_the_leader_and_the_heartbeat(
    start_pool: Callable[..., Pool], redis_url: str, r: redis.Redis
) -> None:
    # An empty Redis: no leader, no worker record.
    assert run_check("coordinator", redis_url) == 1
    assert run_check("worker-gpu0", redis_url, RESIDENCY_HOST="testhost") == 1
    pool = start_pool()
    pool.wait_for(lambda: r.exists("rsd:worker:testhost") == 1, what="the agent's heartbeat")
    assert run_check("coordinator", redis_url) == 0
    assert run_check("coordinator-standby", redis_url) == 0
    assert run_check("worker-gpu0", redis_url, RESIDENCY_HOST="testhost") == 0
    assert run_check("worker-cpu", redis_url, RESIDENCY_HOST="testhost") == 0
    # Another host's record is not this one's.
    assert run_check("worker-gpu1", redis_url, RESIDENCY_HOST="elsewhere") == 1


def scrape_families(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Series names a scrape can carry (from its # TYPE lines) and each bucket series' le values."""
    names: set[str] = set()
    buckets: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^# TYPE (\S+) (\S+)$", line)
        if m:
            name, typ = m.groups()
            if typ == "counter":  # prometheus-client names the family with or without _total
                names.add(name if name.endswith("_total") else name + "_total")
            elif typ == "histogram":
                names |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            else:
                names.add(name)
        m = re.match(r'^(\w+_bucket)\{.*le="([^"]+)"', line)
        if m:
            buckets.setdefault(m.group(1), set()).add(m.group(2))
    return names, buckets


def test_alerts_and_panels_name_what_a_real_scrape_exports(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool()
    c = client_for(pool)
    # Per-user series (the tokens panel) only exist with metrics.per_user.
    resp = c.patch("/admin/config", json={"metrics": {"per_user": True}}, headers=ADMIN)
    assert resp.status_code == 200, resp.get_json()
    # One real request: a load (load seconds), an answer (requests, time to first token).
    resp = chat(c, "a")
    assert resp.status_code == 200, resp.get_json()
    pool.wait_for(lambda: pool.state("a") == "ready", what="a ready")
    text = c.get("/metrics", headers=ADMIN).get_data(as_text=True)
    names, buckets = scrape_families(text)
    exprs: list[tuple[str, Any]] = [(r["alert"], r["expr"]) for r in alert_rules()]
    exprs += dashboard_exprs()
    for where, expr in exprs:
        missing = metric_names(expr) - names
        assert not missing, (where, missing)
        # A bucket bound named in a query is one the histogram exports, spelt the same.
        for metric, le in re.findall(r'(residency_\w+_bucket)\{[^}]*le="([^"]+)"', expr):
            assert le in buckets.get(metric, set()), (where, metric, le, buckets.get(metric))
