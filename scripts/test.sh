#!/usr/bin/env bash
# The project's test suite, set-up included: `bash scripts/test.sh` runs all of it (CI runs exactly this).
# `bash scripts/test.sh --quick`: only the tests that start no process and no server and are not slow
# (no torchrun, etcd, s3server, chaos, infra, subprocess or slow marker; tests/process_guard.py keeps
# the markers honest), a few minutes on 2 cores.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k checkpoint`, `bash scripts/test.sh --quick -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [[ "${1:-}" == "--quick" ]]; then
  shift
  tier=(-m "not (torchrun or etcd or s3server or chaos or infra or subprocess or slow)")
fi
bash scripts/setup.sh --test
export PYTHONUNBUFFERED=1
# --durations: CI's log names the slowest tests, where the 25-minute budget goes.
exec .venv/bin/python -m pytest -ra --durations=25 "${tier[@]}" "$@"
