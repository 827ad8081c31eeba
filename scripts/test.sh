#!/usr/bin/env bash
# Install residency with its test tools and run every check: lint, types, the full test suite
# (unit, integration against a real Redis and real llama.cpp, end to end). `bash scripts/test.sh`
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# tests/unit/test_deploy.py validates deploy/compose.yaml with docker-compose (offline); install
# Debian's when missing and we may (root with apt-get). In CI (CI=true) that test fails if it
# still is missing, rather than skipping.
if ! command -v docker-compose >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
    { apt-get update && apt-get install -y --no-install-recommends docker-compose; } \
        || echo "warning: could not install docker-compose; the compose check will skip" >&2
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -p no:cacheprovider "$@"
