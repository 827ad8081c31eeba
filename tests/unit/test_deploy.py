"""deploy/compose.yaml stays in step with the CLI and the environment contract."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from residency.cli import parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
KNOWN_ENV = {"RESIDENCY_REDIS_URL", "RESIDENCY_CONFIG", "RESIDENCY_ADMIN_KEY", "RESIDENCY_DATA_DIR"}


def test_every_role_runs_a_cli_command_with_contract_env() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    commands = set(parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    roles = {n: s for n, s in doc["services"].items() if n != "redis"}
    assert set(roles) == {"coordinator", "worker", "web"}
    for name, svc in roles.items():
        assert svc["command"][0] == name and name in commands
        for var in svc["environment"]:
            assert var in KNOWN_ENV or var.startswith(("RESIDENCY_SERVER_", "RESIDENCY_POOL_"))
        assert svc["environment"]["RESIDENCY_REDIS_URL"].startswith("redis://redis:")


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="docker-compose not installed")
def test_compose_file_is_valid() -> None:
    env = {**os.environ, "RESIDENCY_ADMIN_KEY": "x"}
    subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], check=True, env=env, timeout=60
    )
