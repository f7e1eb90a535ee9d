#!/usr/bin/env bash
# The goodput model validated against a measured run (issue 27): a time-compressed segment of a node
# availability trace replayed on the chaos cluster (3 torchrun agents with 1, 2 and 1 workers on a
# private etcd3), its goodput measured as `elastic-ft goodput` does, and bench/goodput_model.py run on
# the same segment with the costs calibrated on the cluster just before; they must agree within 5 points
# (see tests/chaos/test_trace_replay.py). Needs a quiet machine: 3-8 minutes per segment.
#
#   scripts/validate_goodput.sh [--trace PATH]    (PATH: e.g. the 32-node p3 Spot trace; without it the
#                                                  synthetic segment only)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--trace" ]; then
  [ -r "${2:-}" ] || { echo "scripts/validate_goodput.sh: --trace: cannot read '${2:-}'" >&2; exit 2; }
  export ELASTIC_FT_TRACE="$2"; shift 2
fi
[ $# -eq 0 ] || { echo "scripts/validate_goodput.sh: unknown argument '$1' (use --trace PATH)" >&2; exit 2; }
python="${PYTHON:-.venv/bin/python}"
ELASTIC_FT_VALIDATE=1 PYTHONPATH="$PWD" exec "$python" -m pytest -q -p no:cacheprovider --timeout=0 \
  tests/chaos/test_trace_replay.py
