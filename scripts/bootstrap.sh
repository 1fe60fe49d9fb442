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
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    # No GPU: pin the torch that this project's CPU machines carry as a CPU build; an unpinned resolve would pick
    # a newer CUDA build and its gigabytes of libraries.
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
