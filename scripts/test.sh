#!/usr/bin/env bash
# Install residency with its test tools and run every check: lint, types, the full test suite
# (unit, integration against a real Redis and real llama.cpp, end to end). `bash scripts/test.sh`
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# Tools some tests need, from Debian when missing and we may (root with apt-get), in one
# apt-get run: docker-compose (tests/unit/test_deploy.py validates deploy/compose.yaml offline)
# and chromium with chromium-driver (tests/e2e/test_dashboard.py drives the admin dashboard
# headless through selenium, which the test extra installs), and prometheus for its promtool
# (tests/unit/test_deploy.py checks deploy/prometheus with it; that one test skips without it).
# In CI (CI=true) the others fail if a tool is still missing, rather than skipping.
missing=()
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ "${#missing[@]}" -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; } \
        || echo "warning: could not install ${missing[*]}; the tests that need them will skip" >&2
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -p no:cacheprovider "$@"
