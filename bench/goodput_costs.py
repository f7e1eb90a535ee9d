"""The cost table of the goodput model: what each thing a run does costs, every figure with its source.

Two profiles. ``cpu``: this machine's figures, from ``bench/preemption.py``
(issue 26 quotes its run on main of 2026-12-03; README "Spot notices" has an
older run) and from the tiny spec's events measured here. ``gpu``: an 8B LoRA
(specs/llama-3.1-8b-lora-spot.yaml) on 8-GPU nodes; every figure is derived
from a stated source or marked ``assumed``. ``--costs FILE.json`` overrides
any field: ``{"micro_step_s": 0.4}`` or ``{"micro_step_s": {"value": 0.4,
"source": "measured on p5"}}``; the source printed is the file's.

How a cost enters the model (``bench/goodput_sim.py``):

- a step: ``micro_step_s`` x the slowest rank's micro-batches from
  ``plan_batch`` + ``step_sync_s``;
- a save (async): training blocks ``ckpt_block_s``; committed
  ``ckpt_upload_s`` later; a save due while one uploads waits for it;
- a spot notice: the step in flight ends, ``commit_sync_s`` (checkpoint),
  ``leave_rendezvous_s`` (restart), ``worker_start_s`` + ``load_s`` (loading);
- an unannounced loss: ``detect_s`` + ``rendezvous_s`` (restart), then
  loading as above; the steps since the last commit are redone;
- a node arriving: its agent starts and joins the rendezvous
  (``join_boot_s``) while the others train on; then the running workers
  commit (``commit_sync_s``), ``join_rendezvous_s`` (restart),
  ``worker_start_s`` + ``load_s`` + ``join_fetch_s`` (loading: the new
  node's inputs);
- the first start: ``initial_restart_s`` (restart: agent start -> worker
  start), ``initial_load_s`` (loading: worker start -> resume plan), as
  ``elastic-ft goodput`` splits an attempt.
"""

from __future__ import annotations

import dataclasses
import json
import math

MAX_SECONDS = 86_400.0
_ISSUE26 = "issue 26: bench/preemption.py on main, 3 preemptions (notice, kill, silent) at one per 67 s"
_TINY = "tiny spec events measured here (bench/preemption.py --keep, 2026-12-03 16:45 UTC)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds (and sizes) the model charges; see the module docstring for where each enters."""

    name: str
    gpus_per_node: int
    global_batch: int | None
    """Samples per step (constant_global); None: 2 micro-batches per rank at the largest world."""
    micro_batch: int
    tokens_per_sample: float
    every_steps: int
    micro_step_s: float
    step_sync_s: float
    ckpt_block_s: float
    ckpt_upload_s: float
    commit_sync_s: float
    notice_poll_s: float
    leave_rendezvous_s: float
    detect_s: float
    rendezvous_s: float
    worker_start_s: float
    load_s: float
    join_rendezvous_s: float
    join_fetch_s: float
    join_boot_s: float
    initial_restart_s: float
    initial_load_s: float
    sources: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def replace(self, **changes) -> Costs:
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name for f in dataclasses.fields(Costs)} - {"name", "sources"}
_INTS = {"gpus_per_node", "micro_batch", "every_steps", "global_batch"}

# ---------------------------------------------------------------------------------------- CPU (this machine)
# bench/preemption.py (issue 26's run): notice -> first step 9.2 s, of which worker start 6.8 s; hard kill ->
# first step 15.8 s = re-rendezvous 6.1 + worker start 7.3 + 2.4 (detection: the agent sees the peer's reset);
# silent 15.4 s; a returning node pauses training 11-14 s; goodput 53.4 % at one preemption per 67 s.
_CPU_WORKER_START = (6.8 + 7.3) / 2
_CPU_COMMIT = 0.062
_CPU_MICRO = 0.05
_CPU_POLL = 1.0
_CPU_FIRST_START = 3 * 67.0 - 180.0  # issue 26's wall less the 180 s it trains after the first step
CPU = Costs(
    name="cpu", gpus_per_node=1, global_batch=32, micro_batch=8, tokens_per_sample=30.0, every_steps=20,
    micro_step_s=_CPU_MICRO, step_sync_s=0.0, ckpt_block_s=0.0045, ckpt_upload_s=0.083,
    commit_sync_s=_CPU_COMMIT, notice_poll_s=_CPU_POLL,
    leave_rendezvous_s=round(9.2 - 6.8 - _CPU_COMMIT - _CPU_MICRO - _CPU_POLL, 3), detect_s=round(15.8 - 6.1 - 7.3, 3),
    rendezvous_s=6.1, worker_start_s=_CPU_WORKER_START, load_s=0.0,
    join_rendezvous_s=round(12.5 - _CPU_WORKER_START - _CPU_COMMIT, 3), join_fetch_s=0.0,
    join_boot_s=round((4.9 + 8.5) / 2, 2),
    initial_restart_s=round(_CPU_FIRST_START - _CPU_WORKER_START, 3), initial_load_s=_CPU_WORKER_START,
    sources={
        "gpus_per_node": "one rank per node (the bench's nodes run 1 and 2 workers; one here)",
        "global_batch": "specs/tiny-lora.yaml batch.global_batch",
        "micro_batch": "specs/tiny-lora.yaml batch.micro_batch",
        "tokens_per_sample": "assumed: tiny corpus samples padded to their micro-batch's longest (max_length 48)",
        "every_steps": "specs/tiny-lora.yaml checkpoint.every_steps",
        "micro_step_s": f"{_TINY}: median gap between step_done events at world 3 (0.07-0.12 s over the "
                        f"attempts, 0.10 taken) / 2 micro-batches (plan_batch: 11 samples a rank, micro-batch 8)",
        "step_sync_s": "included in micro_step_s (gloo on one host)",
        "ckpt_block_s": f"{_TINY}: median blocked_s of checkpoint_committed",
        "ckpt_upload_s": f"{_TINY}: median seconds of checkpoint_committed (file://)",
        "commit_sync_s": f"{_TINY}: median seconds of the preempted events (0.017-0.119 s)",
        "notice_poll_s": "product default: IMDS polled every second (spot watcher)",
        "leave_rendezvous_s": f"{_ISSUE26}: 9.2 s notice -> first step, less worker start 6.8 s, and what the "
                              f"model charges itself: the poll (1 s), the commit and a step's boundary wait",
        "detect_s": f"{_ISSUE26}: kill -> first step 15.8 s less re-rendezvous 6.1 s and worker start 7.3 s",
        "rendezvous_s": f"{_ISSUE26}: re-rendezvous after a kill 6.1 s",
        "worker_start_s": f"{_ISSUE26}: worker start, mean of 6.8 s (notice) and 7.3 s (kill)",
        "load_s": "included in worker_start_s (the tiny checkpoint is a few MB on file://)",
        "join_rendezvous_s": f"{_ISSUE26}: a returning node pauses training 11-14 s (12.5 s taken), less worker "
                            f"start and the commit",
        "join_fetch_s": "0: the bench's node restarts on the same host, its inputs in place",
        "join_boot_s": "validation run (bench/trace_replay.py calibration, chaos cluster here): a started node's "
                       "agent start -> the survivors' last step before the join, 4.9-8.5 s (midpoint taken)",
        "initial_restart_s": f"{_ISSUE26}: its first start (wall 3 x 67 s less the 180 s trained after the first "
                             f"step: 21 s) less the loading part below",
        "initial_load_s": f"{_ISSUE26}: worker start, as worker_start_s (the first worker's start -> resume plan "
                          f"does what a restarted one does; the tiny corpus's token store is built within it)",
    })

# ------------------------------------------------------------------------------- GPU (8B LoRA, 8-GPU nodes)
_PARAMS = 8.03e9  # README: Llama-3.1-8B
_ADAPTERS = 41.9e6  # README: LoRA r 16 on all seven projections, float32
_CKPT_BYTES = _ADAPTERS * 12  # weights + AdamW's two moments, float32 (README: adapters and AdamW state only)
_S3_BPS = 1.0e9  # assumed: one node's parallel ranged S3 transfers (checkpoint store), ~8 Gbit/s
_S3_ONE_STREAM_BPS = 0.1e9  # assumed: inputs/remote.py fetches one stream per file (issue 26)
_BASE_BYTES = 16.1e9  # README: bf16 base weights
_DISK_BPS = 2.0e9  # assumed: node-local NVMe (page cache often better)
_TOKENS = 2048
_FLOPS = 6 * _PARAMS * _TOKENS  # forward 2N + activation grads 2N + recompute 2N (no base weight grads)
_H100_FLOPS, _MFU = 989e12, 0.40  # H100 SXM dense bf16 (NVIDIA datasheet); MFU assumed
GPU = Costs(
    name="gpu", gpus_per_node=8, global_batch=None, micro_batch=1, tokens_per_sample=_TOKENS, every_steps=50,
    micro_step_s=round(_FLOPS / (_H100_FLOPS * _MFU), 3), step_sync_s=0.05,
    ckpt_block_s=round(_CKPT_BYTES / 20e9 + 0.05, 3), ckpt_upload_s=round(_CKPT_BYTES / _S3_BPS + 0.5, 2),
    commit_sync_s=round(_CKPT_BYTES / _S3_BPS + 0.5, 2), notice_poll_s=1.0,
    leave_rendezvous_s=CPU.leave_rendezvous_s, detect_s=CPU.detect_s, rendezvous_s=CPU.rendezvous_s,
    worker_start_s=round(25.0 + _BASE_BYTES / _DISK_BPS, 1), load_s=round(_CKPT_BYTES / _S3_BPS, 2),
    join_rendezvous_s=CPU.join_rendezvous_s, join_fetch_s=round(_BASE_BYTES / _S3_ONE_STREAM_BPS, 1),
    join_boot_s=CPU.join_boot_s,
    initial_restart_s=CPU.rendezvous_s, initial_load_s=round(25.0 + _BASE_BYTES / _S3_ONE_STREAM_BPS, 1),
    sources={
        "gpus_per_node": "p5.48xlarge: 8 H100 (AWS instance type)",
        "global_batch": "assumed: 2 samples per rank at the largest world (the spec's 32 fits 2 nodes)",
        "micro_batch": "specs/llama-3.1-8b-lora-spot.yaml batch.micro_batch",
        "tokens_per_sample": "specs/llama-3.1-8b-lora-spot.yaml data.max_length (samples assumed full)",
        "every_steps": "specs/llama-3.1-8b-lora-spot.yaml checkpoint.every_steps",
        "micro_step_s": "6 x 8.03e9 params x 2048 tokens / (989 TFLOP/s H100 bf16 x 40 % MFU, MFU assumed)",
        "step_sync_s": "assumed: all-reduce of 168 MB of LoRA gradients + optimizer step",
        "ckpt_block_s": "503 MB (41.9 M adapters x 12 B: weights + AdamW, README) to host at 20 GB/s (assumed) "
                        "+ 0.05 s",
        "ckpt_upload_s": "503 MB at 1 GB/s per node to S3 (assumed) + 0.5 s manifest and hashing (assumed)",
        "commit_sync_s": "as ckpt_upload_s (a synchronous commit uploads the same bytes)",
        "notice_poll_s": "product default: IMDS polled every second",
        "leave_rendezvous_s": "the CPU figure (etcd rounds do not depend on the model)",
        "detect_s": "the CPU figure; NCCL's async error handling assumed as fast as gloo's reset",
        "rendezvous_s": "the CPU figure (etcd rounds do not depend on the model)",
        "worker_start_s": "25 s imports, CUDA context, NCCL init (assumed) + 16.1 GB bf16 base (README) from "
                          "node-local disk at 2 GB/s (assumed)",
        "load_s": "503 MB checkpoint at 1 GB/s from S3 (assumed bandwidth)",
        "join_rendezvous_s": "the CPU figure",
        "join_fetch_s": "16.1 GB base (README) fetched by the new node at 100 MB/s, one stream per file "
                        "(inputs/remote.py, issue 26; bandwidth assumed)",
        "join_boot_s": "the CPU figure (agent start and etcd join, before any model work)",
        "initial_restart_s": "the CPU rendezvous_s (agent start -> worker start: the first round)",
        "initial_load_s": "25 s start (as worker_start_s, assumed) + the base fetched from S3 at 100 MB/s "
                          "(assumed)",
    })

PROFILES = {"cpu": CPU, "gpu": GPU}


class CostsError(ValueError):
    """A cost file that cannot be used; the message names the field and what to do."""


def override(base: Costs, doc: dict, origin: str) -> Costs:
    """``base`` with the fields of ``doc`` (a number, or ``{"value", "source"}``); raises :class:`CostsError`."""
    if not isinstance(doc, dict):
        raise CostsError(f"{origin}: expected a JSON object of cost fields, e.g. {{\"micro_step_s\": 0.4}}")
    changes, sources = {}, dict(base.sources)
    for key, raw in doc.items():
        if key not in _FIELDS:
            raise CostsError(f"{origin}: unknown cost field {key!r}; known: {', '.join(sorted(_FIELDS))}")
        value, source = (raw.get("value"), raw.get("source")) if isinstance(raw, dict) else (raw, None)
        changes[key] = _checked(key, value, origin)
        sources[key] = str(source) if source else f"{origin}"
    return dataclasses.replace(base, **changes, sources=sources)


def _checked(key: str, value, origin: str):
    if key == "global_batch" and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CostsError(f"{origin}: {key} must be a number, got {value!r}")
    if key in _INTS:
        if value != int(value) or not 1 <= value <= 1_000_000:
            raise CostsError(f"{origin}: {key} must be a whole number from 1 to 1000000, got {value!r}")
        return int(value)
    if not 0 <= value <= MAX_SECONDS:
        raise CostsError(f"{origin}: {key} must be from 0 to {MAX_SECONDS:g}, got {value!r}")
    return float(value)


def load(profile: str, path: str | None) -> Costs:
    """The named profile, overridden by the JSON file at ``path``; raises :class:`CostsError` naming the problem."""
    base = PROFILES[profile]
    if path is None:
        return base
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise CostsError(f"--costs: cannot read {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CostsError(f"--costs: {path!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    return override(base, doc, f"--costs {path}")
