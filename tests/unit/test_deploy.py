"""deploy/ stays in step with the code: the image's targets, the Compose file (roles, the
environment contract, GPUs, the security rules of docs/operations.md), the generated
deploy/.env.example, and the Prometheus alerts and Grafana panels (every metric they name is
one the box exports)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from residency import envexample, settings
from residency.cli import parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"
OPERATIONS = ROOT / "docs" / "operations.md"
PASSWORD_VAR = "RESIDENCY_REDIS_PASSWORD"

#: Environment variables the roles read besides the settings (RESIDENCY_<SECTION>_<KEY>).
CONTRACT_ENV = {
    "RESIDENCY_REDIS_URL",
    "RESIDENCY_CONFIG",
    "RESIDENCY_ADMIN_KEY",
    "RESIDENCY_DATA_DIR",
    "RESIDENCY_HOST",
    "RESIDENCY_DEVICES",
    "RESIDENCY_LOG_LEVEL",
}
#: Variables only Compose uses (substituted into compose.yaml); they reach the roles through
#: deploy/.env but are no setting.
COMPOSE_ONLY_ENV = {PASSWORD_VAR, "GRAFANA_ADMIN_PASSWORD"}
ROLE_SERVICES = {
    "coordinator",
    "coordinator-standby",
    "worker-gpu0",
    "worker-gpu1",
    "worker-cpu",
    "web",
}


def setting_env_names() -> set[str]:
    return {envexample.env_name(k) for k in settings.key_meta()}


def compose_doc() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def roles(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the residency image."""
    return {
        n: s for n, s in doc["services"].items() if str(s.get("image", "")).startswith("residency:")
    }


# --- the image ---------------------------------------------------------------------------------


def dockerfile_stages() -> dict[str, dict[str, Any]]:
    """Each stage's base image and instructions, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.match(r"^(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)$", rest.strip(), re.I)
            assert m, f"every stage is named: {line}"
            current = {"base": m.group(1), "ops": []}
            stages[m.group(2)] = current
        elif current is not None:
            current["ops"].append((op, " ".join(rest.split())))
    return stages


def ops(stage: dict[str, Any], op: str) -> list[str]:
    return [rest for o, rest in stage["ops"] if o == op]


def test_image_has_a_cpu_and_a_cuda_target_without_compilers() -> None:
    stages = dockerfile_stages()
    assert {"cpu", "cuda", "cpu-builder", "cuda-builder"} <= set(stages)
    assert stages["cpu"]["base"] == stages["cpu-builder"]["base"] == "python:3.11-slim"
    assert re.fullmatch(
        r"nvidia/cuda:\$\{CUDA_VERSION\}-devel-\$\{CUDA_OS\}", stages["cuda-builder"]["base"]
    )
    assert re.fullmatch(
        r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-\$\{CUDA_OS\}", stages["cuda"]["base"]
    )
    assert re.search(r"^ARG CUDA_VERSION=12\.", DOCKERFILE.read_text(), re.M)
    for name in ("cpu", "cuda"):
        final = stages[name]
        body = " ".join(rest for _, rest in final["ops"])
        for tool in ("build-essential", "cmake", "gcc", "g++", "clang", "-dev "):
            assert tool not in body, f"{name} installs {tool}"
        users = ops(final, "USER")
        assert users, f"{name} runs as root"
        assert users[-1].split(":")[0] not in ("root", "0")
        assert users[-1] == "10001:10001"
        # Only the builder's venv comes over, from this target's own builder.
        copies = ops(final, "COPY")
        assert copies == [f"--from={name}-builder /opt/venv /opt/venv"]
        assert ops(final, "ENTRYPOINT") == ['["residency"]']
        assert any("/opt/venv/bin" in e for e in ops(final, "ENV"))
    # The builders build llama-cpp-python through scripts/install.sh into /opt/venv, with the
    # flags each target needs.
    for name, flags in (
        ("cpu-builder", ["-DGGML_NATIVE=OFF"]),
        ("cuda-builder", ["-DGGML_CUDA=on", "-DGGML_NATIVE=OFF"]),
    ):
        builder = stages[name]
        cmake_arg = next(a for a in ops(builder, "ARG") if a.startswith("LLAMA_CMAKE_ARGS="))
        for flag in flags:
            assert flag in cmake_arg, (name, flag)
        run = " ".join(ops(builder, "RUN"))
        assert "scripts/install.sh" in run and "RESIDENCY_VENV=/opt/venv" in run
        assert 'LLAMA_CMAKE_ARGS="$LLAMA_CMAKE_ARGS"' in run
    # The venv's interpreter is a symlink: the final stage has the same Python at the same path.
    assert "PYTHON=/usr/local/bin/python3.11" in " ".join(ops(stages["cpu-builder"], "RUN"))
    assert "PYTHON=/usr/bin/python3.11" in " ".join(ops(stages["cuda-builder"], "RUN"))
    assert " python3.11 " in " ".join(ops(stages["cuda"], "RUN")) + " "


def install_extras(stage: dict[str, Any]) -> list[str]:
    """The extras a builder stage hands scripts/install.sh (its arguments)."""
    run = next(r for r in ops(stage, "RUN") if "scripts/install.sh" in r)
    return run.split("scripts/install.sh", 1)[1].split()


def test_the_cuda_image_installs_the_nvml_binding() -> None:
    # workers/devices.py (a GPU's total: its byte budget) and workers/memory.py (a model's
    # measured footprint) read GPU memory through pynvml; without it neither is known.
    for module in ("devices", "memory"):
        assert "import pynvml" in (ROOT / "workers" / f"{module}.py").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(re.match(r"nvidia-ml-py\b", req) for req in extras["cuda"])
    stages = dockerfile_stages()
    assert "cuda" in install_extras(stages["cuda-builder"])
    # Always, whatever EXTRAS a build passes; and the CPU image has no GPU to read.
    assert install_extras(stages["cuda-builder"])[0] == "cuda"
    assert "cuda" not in install_extras(stages["cpu-builder"])


# --- Compose -----------------------------------------------------------------------------------


def test_every_role_runs_a_cli_command_with_known_env() -> None:
    doc = compose_doc()
    commands = set(parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"web", "coordinator", "worker", "up"} <= commands
    rs = roles(doc)
    assert set(rs) == ROLE_SERVICES
    valid = setting_env_names() | CONTRACT_ENV
    for name, svc in rs.items():
        command = svc["command"][0]
        assert command in commands and name.split("-")[0] == command, name
        for var in svc["environment"]:
            assert var in valid, f"{name}: {var} is neither a setting nor a contract variable"
        assert svc["env_file"] == ".env"
    # A leader and a standby: the standby takes over when the leader dies.
    assert sorted(n for n, s in rs.items() if s["command"] == ["coordinator"]) == [
        "coordinator",
        "coordinator-standby",
    ]


def test_contract_variables_are_read_by_the_code() -> None:
    source = "\n".join(
        p.read_text()
        for d in ("residency", "web", "coordinator", "workers")
        for p in (ROOT / d).rglob("*.py")
    )
    for var in CONTRACT_ENV:
        assert f'"{var}"' in source, f"nothing reads {var}"


def test_one_worker_per_gpu_on_the_cuda_image() -> None:
    rs = roles(compose_doc())
    gpus = {n: s for n, s in rs.items() if n.startswith("worker-gpu")}
    assert set(gpus) == {"worker-gpu0", "worker-gpu1"}
    hosts = set()
    for i, (name, svc) in enumerate(sorted(gpus.items())):
        assert svc["build"]["target"] == "cuda" and svc["image"] == "residency:cuda"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert device["device_ids"] == [str(i)], name
        # The container sees its one GPU as the first: the agent is told so.
        assert svc["environment"]["RESIDENCY_DEVICES"] == "cuda:0"
        hosts.add(svc["environment"]["RESIDENCY_HOST"])
    cpu = rs["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and cpu["build"]["target"] == "cpu"
    hosts.add(cpu["environment"]["RESIDENCY_HOST"])
    assert len(hosts) == 3  # every agent has its own host id
    for name, svc in rs.items():
        if not name.startswith("worker"):
            assert svc["build"]["target"] == "cpu" and svc["image"] == "residency:cpu"
            assert "deploy" not in svc


def test_every_service_has_a_real_health_check() -> None:
    doc = compose_doc()
    for name, svc in roles(doc).items():
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], name
        if name == "web":
            assert "/readyz" in test[3]
        elif name.startswith("worker"):
            assert "keys.worker(os.environ['RESIDENCY_HOST'])" in test[3]
            assert svc["environment"]["RESIDENCY_HOST"]
        else:
            assert "keys.leader()" in test[3]
    assert doc["services"]["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_redis_needs_a_password_that_every_url_carries() -> None:
    doc = compose_doc()
    redis_svc = doc["services"]["redis"]
    command = redis_svc["command"]
    assert command[command.index("--requirepass") + 1].startswith("${" + PASSWORD_VAR + ":?")
    assert command[command.index("--appendonly") + 1] == "yes"  # AOF: state survives restarts
    assert "ports" not in redis_svc  # reachable from the compose network only
    for name, svc in roles(doc).items():
        url = svc["environment"]["RESIDENCY_REDIS_URL"]
        assert url.startswith("redis://:${" + PASSWORD_VAR + ":?"), name
        assert url.endswith("@redis:6379/0"), name
    # Whatever is published is published on loopback only (a reverse proxy fronts web).
    for name, svc in doc["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), name
    assert doc["services"]["web"]["ports"] == ["127.0.0.1:8000:8000"]


def test_compose_only_variables_are_no_settings() -> None:
    # deploy/.env reaches every role: a compose-only variable that a settings section claimed
    # would stop the roles at start ("unknown key").
    assert settings.env_layer({v: "x" for v in COMPOSE_ONLY_ENV}) == {}
    assert not COMPOSE_ONLY_ENV & (setting_env_names() | CONTRACT_ENV)


# --- deploy/.env.example -----------------------------------------------------------------------


def test_env_example_is_generated_from_the_settings() -> None:
    assert (DEPLOY / ".env.example").read_text() == envexample.render(), (
        "deploy/.env.example is stale: run `python -m residency.envexample --write`"
    )


def env_example_lines() -> dict[str, str]:
    out = {}
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        m = re.match(r"^#? ?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_env_example_names_every_setting_with_a_default_that_reads_back() -> None:
    lines = env_example_lines()
    assert set(lines) == setting_env_names() | set(envexample.SECRETS)
    assert set(envexample.SECRETS) == {"RESIDENCY_ADMIN_KEY", *COMPOSE_ONLY_ENV}
    # Every commented default, uncommented, is read back as that default.
    env = {k: v for k, v in lines.items() if k not in envexample.SECRETS}
    layer = settings.env_layer(env)
    built = settings.build(layer)
    for dotted, meta in settings.key_meta().items():
        section, _, key = dotted.partition(".")
        assert getattr(getattr(built, section), key) == meta["default"], dotted


# --- docker-compose config ---------------------------------------------------------------------


def require_docker_compose() -> None:
    """docker-compose, or a skip — except in CI (CI=true), where a missing tool is a failure:
    scripts/test.sh installs it, so this check never silently stops running."""
    if shutil.which("docker-compose"):
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("docker-compose is not installed (scripts/test.sh installs it as root)")
    pytest.skip("docker-compose not installed")


def deploy_copy(tmp_path: Path, secrets: dict[str, str]) -> Path:
    """deploy/ with a .env made from .env.example the way an operator makes it."""
    dest = tmp_path / "deploy"
    shutil.copytree(DEPLOY, dest, ignore=shutil.ignore_patterns(".env", "metrics.key"))
    text = (DEPLOY / ".env.example").read_text()
    for name, value in secrets.items():
        text = re.sub(rf"^{name}=$", f"{name}={value}", text, flags=re.M)
    (dest / ".env").write_text(text)
    return dest / "compose.yaml"


def compose(compose_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in envexample.SECRETS and not k.startswith("COMPOSE_")
    }
    return subprocess.run(
        ["docker-compose", "-f", str(compose_file), *args],
        env=env,
        cwd=compose_file.parent,
        timeout=60,
        capture_output=True,
        text=True,
    )


def test_compose_file_is_valid(tmp_path: Path) -> None:
    require_docker_compose()
    secrets = {"RESIDENCY_ADMIN_KEY": "x", PASSWORD_VAR: "s3cret", "GRAFANA_ADMIN_PASSWORD": "g"}
    file = deploy_copy(tmp_path / "ok", secrets)
    assert compose(file, "config", "-q").returncode == 0
    done = compose(file, "--profile", "cpu", "config")
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert set(roles(resolved)) == ROLE_SERVICES
    for name, svc in roles(resolved).items():
        assert svc["environment"]["RESIDENCY_REDIS_URL"] == "redis://:s3cret@redis:6379/0", name
        # deploy/.env reaches the role: only settings, contract and compose-only variables.
        assert set(svc["environment"]) <= setting_env_names() | CONTRACT_ENV | COMPOSE_ONLY_ENV
    assert "s3cret" in resolved["services"]["redis"]["command"]
    assert resolved["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "g"
    # Without the password the file does not even resolve: no Redis without one.
    missing = compose(
        deploy_copy(tmp_path / "missing", {**secrets, PASSWORD_VAR: ""}), "config", "-q"
    )
    assert missing.returncode != 0 and PASSWORD_VAR in missing.stderr


# --- metrics: what the box exports, and what alerts and dashboards name ------------------------


@cache
def exported_metrics() -> frozenset[str]:
    """Every series name the box's /metrics can carry: the names residency/metrics.py defines
    (Redis-held counters and histograms, the health record's gauges) and web's own metrics
    (prometheus-client's default registry), with the _bucket/_sum/_count of each histogram."""
    from prometheus_client import REGISTRY

    import web.routing  # noqa: F401  (registers web's metrics: requests, TTFT, routing)
    from residency import metrics

    names = {v for v in vars(metrics).values() if isinstance(v, str) and v.startswith("residency_")}
    histograms = set(metrics._HISTOGRAMS)
    for fam in REGISTRY.collect():
        if not fam.name.startswith("residency_"):
            continue
        if fam.type == "histogram":
            histograms.add(fam.name)
        names.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    for h in histograms:
        names |= {h, f"{h}_bucket", f"{h}_sum", f"{h}_count"}
    return frozenset(names)


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(residency_[a-z0-9_]+)", expr))


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                out.append((panel["title"], target["expr"]))
    return out


def test_alert_rules_name_only_exported_metrics() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names)
    for want in (
        "ResidencyNoLeader",
        "ResidencyHostGone",
        "ResidencyLoadPastBudget",
        "ResidencyQueueWaitHigh",
        "ResidencyThrash",
        "ResidencyDeviceOverBudget",
        "ResidencyLimitLiftedWithoutBackstop",
    ):
        assert want in names
    for rule in rules:
        used = metric_names(rule["expr"])
        # `up` is Prometheus's own: whether the scrape of web succeeded.
        assert used or rule["expr"].startswith("up{"), rule["alert"]
        assert used <= exported_metrics(), (rule["alert"], used - exported_metrics())
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_every_alert_is_explained_in_operations() -> None:
    text = OPERATIONS.read_text()
    section = text.split("## What each alert means", 1)[1].split("\n## ", 1)[0]
    for rule in alert_rules():
        assert f"**{rule['alert']}**" in section, rule["alert"]


def test_grafana_panels_name_only_exported_metrics() -> None:
    exprs = dashboard_exprs()
    for title, expr in exprs:
        used = metric_names(expr)
        assert used, title
        assert used <= exported_metrics(), (title, used - exported_metrics())
    titles = {t for t, _ in exprs}
    for want in (
        "Residents",
        "Limits: effective vs configured",
        "Loads",
        "Evictions",
        "Age at eviction",
        "Queue depth by model",
        "Time to first token",
        "Tokens per second",
        "Requests and errors",
        "Memory ledger per device",
    ):
        assert want in titles
    # The panels use the provisioned data source.
    (ds,) = yaml.safe_load((DATASOURCES / "prometheus.yml").read_text())["datasources"]
    for path in DASHBOARDS.glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            assert panel["datasource"]["uid"] == ds["uid"]
    assert ds["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_web_and_loads_the_alerts() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/alerts.yml"]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "residency"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["web:8000"]
    assert job["authorization"]["credentials_file"].startswith("/etc/prometheus/")
    # The alerts' job label is this job's.
    assert all('job="residency"' in r["expr"] for r in alert_rules() if "up{" in r["expr"])
    mounts = compose_doc()["services"]["prometheus"]["volumes"]
    assert "./prometheus:/etc/prometheus:ro" in mounts


def test_promtool_accepts_the_rules_and_config(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    done = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The config, with its paths where compose mounts them relative to a copy.
    etc = tmp_path / "prometheus"
    shutil.copytree(DEPLOY / "prometheus", etc)
    (etc / "metrics.key").write_text("k\n")
    text = (etc / "prometheus.yml").read_text().replace("/etc/prometheus/", f"{etc}/")
    (etc / "prometheus.yml").write_text(text)
    done = subprocess.run(
        [promtool, "check", "config", str(etc / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
