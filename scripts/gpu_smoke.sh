#!/usr/bin/env bash
# A ready GPU check (not part of CI): the tiny job with LoRA and with fsdp on 1 and 2 GPUs over NCCL in
# bf16, a spot notice served by a local IMDS, a hard kill of one rank, and the step bench; it prints the
# figures and exits non-zero on any failure (see bench/gpu_smoke.py for what each check proves).
#
#   scripts/gpu_smoke.sh [--dry-run] [--gpus N] [--only lora-1,fsdp-2,...] [--keep DIR] [--cpu]
#
# Exit status: 0 every check passed (2-GPU checks are skipped, and said so, on a host with one GPU),
# 1 a check failed (its log's tail is printed), 2 refused: no NVIDIA GPU here, no CUDA build of torch,
# no bf16, or bad arguments. --dry-run prints the plan and its commands anywhere, GPU or not; --cpu
# rehearses every check on the CPU (gloo, float32), which checks this script, not the GPU path.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
if [ ! -x "$python" ]; then
  echo "scripts/gpu_smoke.sh: no Python at $python: run 'bash scripts/setup.sh' first, or set PYTHON" >&2
  exit 2
fi
needs_gpu=1
for arg in "$@"; do
  # The plan (--dry-run) and the rehearsal on the CPU (--cpu) run anywhere.
  if [ "$arg" = "--dry-run" ] || [ "$arg" = "--cpu" ]; then needs_gpu=0; fi
done
# Before anything slower: torch's own check follows in bench/gpu_smoke.py (a CPU build on a GPU host).
if [ "$needs_gpu" = 1 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "scripts/gpu_smoke.sh: no NVIDIA GPU here (nvidia-smi not found); run it on a GPU host, or add --dry-run to see the plan" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$python" bench/gpu_smoke.py "$@"
