#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (pass pytest args to narrow it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec .venv/bin/python -m pytest "$@"
