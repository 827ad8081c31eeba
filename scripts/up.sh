#!/usr/bin/env bash
# Install residency with the demo model and start the whole box: `bash scripts/up.sh [ARGS]`
# (ARGS go to `residency up`, e.g. --port 8080 or --config my.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh demo
exec .venv/bin/residency up "$@"
