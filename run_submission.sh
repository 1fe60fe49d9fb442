#!/usr/bin/env bash
# Runs the MLPerf qwen3-vl-235b-a22b benchmark end to end (see --help): sets up .venv, then the harness.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"
bash scripts/bootstrap.sh
exec .venv/bin/python -m harness "$@"
