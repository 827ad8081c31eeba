"""deploy/compose.yaml stays in step with the CLI and the environment contract, and with the
security rules of docs/operations.md (a password on Redis, carried by every URL)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from residency.cli import parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
KNOWN_ENV = {"RESIDENCY_REDIS_URL", "RESIDENCY_CONFIG", "RESIDENCY_ADMIN_KEY", "RESIDENCY_DATA_DIR"}
PASSWORD_VAR = "RESIDENCY_REDIS_PASSWORD"


def _roles(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in doc["services"].items() if n != "redis"}


def test_every_role_runs_a_cli_command_with_contract_env() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    commands = set(parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    roles = _roles(doc)
    assert set(roles) == {"coordinator", "coordinator-standby", "worker", "web"}
    for name, svc in roles.items():
        command = svc["command"][0]
        assert command in commands and name.split("-")[0] == command
        for var in svc["environment"]:
            assert var in KNOWN_ENV or var.startswith(("RESIDENCY_SERVER_", "RESIDENCY_POOL_"))
    # A leader and a standby: the standby takes over when the leader dies.
    assert [n for n, s in roles.items() if s["command"] == ["coordinator"]] == [
        "coordinator",
        "coordinator-standby",
    ]


def test_redis_needs_a_password_that_every_url_carries() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    redis_svc = doc["services"]["redis"]
    command = redis_svc["command"]
    assert command[command.index("--requirepass") + 1].startswith("${" + PASSWORD_VAR + ":?")
    assert "ports" not in redis_svc  # reachable from the compose network only
    for name, svc in _roles(doc).items():
        url = svc["environment"]["RESIDENCY_REDIS_URL"]
        assert url.startswith("redis://:${" + PASSWORD_VAR + ":?"), name
        assert url.endswith("@redis:6379/0"), name
    # The web port is published on loopback only (a reverse proxy fronts it).
    assert all(p.startswith("127.0.0.1:") for p in doc["services"]["web"]["ports"])


def _compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), *args],
        env=env,
        timeout=60,
        capture_output=True,
        text=True,
    )


def require_docker_compose() -> None:
    """docker-compose, or a skip — except in CI (CI=true), where a missing tool is a failure:
    scripts/test.sh installs it, so this check never silently stops running."""
    if shutil.which("docker-compose"):
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("docker-compose is not installed (scripts/test.sh installs it as root)")
    pytest.skip("docker-compose not installed")


def test_compose_file_is_valid() -> None:
    require_docker_compose()
    base = {k: v for k, v in os.environ.items() if k not in (PASSWORD_VAR, "RESIDENCY_ADMIN_KEY")}
    env = {**base, "RESIDENCY_ADMIN_KEY": "x", PASSWORD_VAR: "s3cret"}
    done = _compose("config", env=env)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    for name, svc in _roles(resolved).items():
        assert svc["environment"]["RESIDENCY_REDIS_URL"] == "redis://:s3cret@redis:6379/0", name
    assert "s3cret" in resolved["services"]["redis"]["command"]
    # Without the password the file does not even resolve: no Redis without one.
    missing = _compose("config", "-q", env={**base, "RESIDENCY_ADMIN_KEY": "x"})
    assert missing.returncode != 0 and PASSWORD_VAR in missing.stderr
