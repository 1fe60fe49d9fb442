#!/usr/bin/env bash
# Creates .venv (once) and installs the project with its test extras into it. Safe to re-run.
# What pip and the build backend print (setuptools' editable-install banner, index warnings) goes to
# .venv/bootstrap.log, not the console; a step that fails prints that log's last lines.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
  echo "[bootstrap] creating .venv with $($py --version)" >&2
  "$py" -m venv .venv
fi
log=.venv/bootstrap.log

quietly() {  # runs "$@" with its output appended to $log; on failure, says so with the log's tail and exits
  if ! "$@" >>"$log" 2>&1; then
    echo "[bootstrap] failed: $* (the last lines of $root/$log follow)" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}

stamp=.venv/.q3vl-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  echo "[bootstrap] installing dependencies into .venv (first run takes a few minutes; pip's output in $log)" >&2
  quietly .venv/bin/python -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    # No GPU: pin the torch that this project's CPU machines carry as a CPU build; an unpinned resolve would pick
    # a newer CUDA build and its gigabytes of libraries.
    quietly .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  quietly .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
# Triton's CPU interpreter for the kernel tests (tests/test_kernels_on_interpreter.py): triton and a NumPy 1.x it
# runs with (its interpreter fails on NumPy 2), in a folder of their own that only that test puts on PYTHONPATH.
site=.kernel-interpreter
if [[ ! -f $site/.installed ]]; then
  echo "[bootstrap] installing triton's interpreter into $site (pip's output in $log)" >&2
  quietly .venv/bin/python -m pip install -q --no-deps --target "$site" "triton==3.6.0" "numpy<2"
  touch "$site/.installed"
fi
