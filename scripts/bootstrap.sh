#!/usr/bin/env bash
# Creates .venv (once) and installs the project with its test extras into it. Safe to re-run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
  echo "[bootstrap] creating .venv with $($py --version)" >&2
  "$py" -m venv .venv
fi
stamp=.venv/.q3vl-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  echo "[bootstrap] installing dependencies into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
