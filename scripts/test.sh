#!/usr/bin/env bash
# The project's whole test suite, set-up included: `bash scripts/test.sh`.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k checkpoint`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export PYTHONUNBUFFERED=1
# --durations: CI's log names the slowest tests, where the ~30 min budget goes.
exec .venv/bin/python -m pytest -ra --durations=25 "$@"
