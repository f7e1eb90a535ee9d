#!/usr/bin/env bash
# A longer chaos run on this machine: 3 heterogeneous torchrun agents (1, 2, 1 processes) on a private
# etcd3 and file:// checkpoints, each with its own local IMDS, a seeded random sequence of hard kills
# (the agent's process tree), SIGTERMs to agents, spot notices served by a node's IMDS, silent nodes
# (SIGSTOP, then killed) and returns; after each event the nodes still up must train again within
# CHAOS_STALL_S seconds; once every node is back and their world committed a checkpoint (or the run
# ended), every sample so far was consumed exactly once, no corrupt checkpoint was met, and the loss at
# that step is within 2e-3 of an uninterrupted run's (see tests/chaos/test_chaos.py).
#
#   scripts/chaos.sh [--seed N] [--events N] [--stall-s S]     (defaults: seed 7, 8 events, 150 s)
#
# A failure prints the nodes' log tails; the seed reproduces the same sequence.
set -euo pipefail
cd "$(dirname "$0")/.."
seed=7 events=8 stall=150
while [ $# -gt 0 ]; do
  case "$1" in
    --seed) seed="$2"; shift 2 ;;
    --events) events="$2"; shift 2 ;;
    --stall-s) stall="$2"; shift 2 ;;
    *) echo "scripts/chaos.sh: unknown argument '$1' (use --seed N, --events N, --stall-s S)" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-.venv/bin/python}"
CHAOS_SEED="$seed" CHAOS_EVENTS="$events" CHAOS_STALL_S="$stall" PYTHONPATH="$PWD" \
  exec "$python" -m pytest -q -p no:cacheprovider --timeout=0 tests/chaos/test_chaos.py -k test_seeded_chaos_longer
