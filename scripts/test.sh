#!/usr/bin/env bash
# Install residency with its test tools and run every check: lint, types, the full test suite
# (unit, integration against a real Redis and real llama.cpp, end to end). `bash scripts/test.sh`
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -p no:cacheprovider "$@"
