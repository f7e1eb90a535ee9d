"""scripts/gpu_smoke.sh, the ready GPU check, where no GPU is: it passes shellcheck, refuses clearly, and
plans the checks the issue names (1 and 2 GPUs, LoRA and fsdp in bf16, a notice, a kill, the bench).

Its checks themselves need a GPU; ``--cpu`` rehearses them on the CPU (run by hand: several minutes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_smoke.sh"
BIN = Path(sys.executable).parent
BASH = shutil.which("bash") or "/bin/bash"

pytestmark = pytest.mark.infra  # runs the script and shellcheck


def run(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(REPO))
    if path is not None:
        env["PATH"] = path
    return subprocess.run([BASH, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_script_passes_shellcheck():
    shellcheck = BIN / "shellcheck"
    if not os.access(shellcheck, os.X_OK):
        pytest.fail(f"shellcheck is not installed in {BIN}: install the test extras (pip install -e '.[test]')")
    result = subprocess.run([str(shellcheck), str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_without_a_gpu_it_refuses_in_one_line(tmp_path):
    # A PATH of the one tool the script uses besides bash's builtins, and no nvidia-smi: the script
    # itself refuses, before starting Python.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    bare = run(path=str(bin_dir))
    assert bare.returncode == 2 and bare.stdout == ""
    assert bare.stderr.count("\n") == 1 and "no NVIDIA GPU here" in bare.stderr, bare.stderr
    # nvidia-smi present, but torch sees no CUDA device (a CPU build, or no driver): Python refuses.
    import torch

    if torch.cuda.is_available():
        return  # a GPU host: the checks would run
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    cpu_torch = run(path=str(bin_dir))
    assert cpu_torch.returncode == 2 and cpu_torch.stdout == ""
    assert cpu_torch.stderr.count("\n") == 1 and "no CUDA GPU is visible to torch" in cpu_torch.stderr, \
        cpu_torch.stderr


def plan(gpus: int) -> dict[str, tuple[str, list[str]]]:
    result = run("--dry-run", "--gpus", str(gpus))
    assert result.returncode == 0, result.stderr
    checks: dict[str, tuple[str, list[str]]] = {}
    for line in result.stdout.splitlines():
        if line.startswith(("run ", "skip ")):
            state, name = line.split()[:2]
            checks[name] = (state, [])
        else:
            checks[name][1].append(line.strip())
    return checks


def test_the_plan_on_one_gpu_skips_the_two_gpu_jobs_and_runs_the_rest_on_one():
    checks = plan(1)
    assert list(checks) == ["lora-1", "lora-2", "fsdp-1", "fsdp-2", "notice", "kill", "bench"]
    assert {n for n, (state, _) in checks.items() if state == "skip"} == {"lora-2", "fsdp-2"}
    for name in ("lora-1", "fsdp-1", "notice", "kill"):
        for command in checks[name][1]:
            assert "--nproc-per-node 1" in command and "precision.compute=bfloat16" in command, command
    assert "tiny-full-fsdp.yaml" in checks["fsdp-1"][1][0] and "tiny-lora.yaml" in checks["lora-1"][1][0]
    assert "ELASTIC_FT_FAULTS=kill:rank=0,step=7,restart=0" in checks["kill"][1][0]
    assert "--max-restarts 1" in checks["kill"][1][0]
    assert len(checks["notice"][1]) == 2 and "ELASTIC_FT_IMDS_ENDPOINT=" in checks["notice"][1][0]
    assert "step_overhead.py --world 1" in checks["bench"][1][0]


def test_the_plan_on_two_gpus_runs_every_check_the_shared_ones_on_two():
    checks = plan(2)
    assert all(state == "run" for state, _ in checks.values())
    assert "--nproc-per-node 2" in checks["fsdp-2"][1][0] and "--nproc-per-node 2" in checks["notice"][1][0]
    assert "ELASTIC_FT_FAULTS=kill:rank=1,step=7,restart=0" in checks["kill"][1][0]  # one rank of two
    assert "step_overhead.py --world 2" in checks["bench"][1][0]
    bad = run("--dry-run", "--only", "lora-1,nope")
    assert bad.returncode == 2 and "no check named nope" in bad.stderr
