#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (pass pytest args to narrow it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
# Two pytest workers by default (pytest-xdist, one test file per worker at a time: a file's module fixtures stay in
# one process); Q3VL_TEST_WORKERS=0 runs the suite in this one process.
exec .venv/bin/python -m pytest -n "${Q3VL_TEST_WORKERS:-2}" --dist loadfile "$@"
