"""The resume plan: where a (re)started run continues, decided by a pure function.

Inputs are what the leader found in the store (the newest verified manifest
and the checkpoints skipped on the way) and the world at hand; the output is
the step and cursor to continue from, the rescale since the checkpoint, and a
reason, all logged as one event. Which checkpoint that is was decided before,
from each checkpoint's outcome (:func:`elastic_ft.checkpoint.choice.choose`);
:func:`shape_conflicts` tells whether the current spec can load it at all.
"""

from __future__ import annotations

import dataclasses

from elastic_ft.checkpoint.manifest import Manifest
from elastic_ft.checkpoint.reader import Skipped
from elastic_ft.train.resume_source import CHECKPOINT, MEMORY, ResumeSource
from elastic_ft.train.scaling import BatchPlan, rescale_event

_SHAPING = {"model": ("config",), "lora": ("r", "target_modules", "use_dora", "modules_to_save")}
"""Spec fields that decide which tensors are trained and their shapes. Everything
else (lr, steps, batch, data, ...) may change between restarts of a run.
``model.name_or_path`` is not here: the same model may have moved to another
directory; a different one is caught by :func:`shape_mismatches`."""

_ADDED = {"use_dora": False, "modules_to_save": None}
"""Shaping fields added after runs were committed, at their default: what a checkpoint without them used."""


def _describe(value) -> str:
    return "unset" if value is None else repr(value)


def _diff(path: str, saved, current, out: list[str]) -> None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for k in sorted(set(saved) | set(current), key=str):
            _diff(f"{path}.{k}", saved.get(k), current.get(k), out)
    elif saved != current:
        out.append(f"{path} is {_describe(saved)} in the checkpoint but {_describe(current)} now")


def shape_conflicts(saved: dict, current: dict) -> list[str]:
    """The model-shaping spec fields that differ between a checkpoint's recorded spec and the current one.

    ``saved`` and ``current`` are spec documents (``JobSpec.to_dict()``). One
    entry per field, e.g. "lora.r is 8 in the checkpoint but 16 now"; a nested
    inline ``model.config`` is compared key by key. ``target_modules`` compare
    as sets (their order does not matter to PEFT). A LoRA run against a full
    fine-tune is one entry for ``lora``. Empty when the checkpoint loads.
    """
    out: list[str] = []
    for section, fields in _SHAPING.items():
        old, new = saved.get(section), current.get(section)
        if section == "lora" and (old is None) != (new is None):
            kind = {True: "a full fine-tune", False: "LoRA"}
            out.append(f"lora: the checkpoint is {kind[old is None]}, this spec {kind[new is None]}")
            continue
        old, new = old or {}, new or {}
        for f in fields:
            a, b = old.get(f, _ADDED.get(f)), new.get(f, _ADDED.get(f))
            if f in ("target_modules", "modules_to_save") and isinstance(a, list) and isinstance(b, list):
                a, b = sorted(map(str, a)), sorted(map(str, b))
            _diff(f"{section}.{f}", a, b, out)
    return out


def shape_mismatches(saved: dict[str, tuple], current: dict[str, tuple]) -> list[str]:
    """Trained tensors whose shape in the checkpoint (``saved``: name -> shape) differs from the model's.

    Names present on one side only are left to the loader, which names them.
    """
    return [f"{name} is {list(saved[name])} in the checkpoint but {list(current[name])} now"
            for name in sorted(set(saved) & set(current)) if tuple(saved[name]) != tuple(current[name])]


def incompatible_spec(saved: dict | None, current: dict, *, step: int, run_id: str) -> str | None:
    """One line saying why the checkpoint at ``step`` cannot load under ``current`` and what to do, or None.

    A checkpoint without a recorded spec (``saved`` None) is not judged here.
    """
    if not saved:
        return None
    conflicts = shape_conflicts(saved, current)
    if not conflicts:
        return None
    return (f"the checkpoint at step {step} of run {run_id!r} was trained with another model shape: "
            f"{'; '.join(conflicts)}. These fields cannot change within a run: use the checkpoint's values to "
            f"resume, or start a new run with another --run_id (or checkpoint_uri)")


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    step: int
    cursor: int
    source: str | None
    """Manifest key resumed from (None: fresh start, or a node's kept step: see ``origin``)."""
    skipped: list[Skipped]
    rescale: dict | None
    config_changed: bool
    finished: bool
    reason: str
    origin: ResumeSource | None = None
    """Where the state came from (a node's kept step, or the checkpoint) and why; None: not decided."""

    @property
    def from_memory(self) -> bool:
        return self.origin is not None and self.origin.kind == MEMORY

    def event(self) -> dict:
        origin = (self.origin or ResumeSource(CHECKPOINT, "")).event()
        return {
            "step": self.step, "cursor": self.cursor, "source": self.source, **origin,
            "skipped": [dataclasses.asdict(s) for s in self.skipped], "config_changed": self.config_changed,
            "finished": self.finished, "reason": self.reason,
        }


def plan_resume(manifest: Manifest | None, skipped: list[Skipped], *, plan: BatchPlan, config_hash: str,
                total_steps: int, origin: ResumeSource | None = None) -> ResumePlan:
    """Where the run continues: the loaded state's step and cursor (a checkpoint's manifest, or the
    manifest-shaped record of a node's kept step when ``origin`` is a memory source), the rescale since
    it was saved, and why."""
    if manifest is None:
        why = "no committed checkpoint: starting from step 0"
        if skipped:
            why = (f"every committed checkpoint is corrupt ({len(skipped)} retired to quarantine/): "
                   f"starting from step 0")
        return ResumePlan(0, 0, None, skipped, None, False, False, why, origin)
    changed = manifest.config_hash != config_hash
    rescale = rescale_event(manifest.batch_plan or None, plan)
    if rescale is not None:
        rescale = {"step": manifest.step, **rescale}  # the step training continues from at the new plan
    finished = manifest.step >= total_steps
    memory = origin is not None and origin.kind == MEMORY
    where = f"kept in memory by node {origin.node}" if memory else "saved"
    why = f"resuming from step {manifest.step} (cursor {manifest.cursor}) {where} at world {manifest.world.get('size')}"
    if skipped:
        why += f", after retiring {len(skipped)} newer unusable checkpoint(s) to quarantine/"
    if changed:
        why += "; the spec's training settings changed since that checkpoint"
    if finished:
        why += f"; the run is already complete ({total_steps} steps)"
    return ResumePlan(manifest.step, manifest.cursor, None if memory else manifest.key, skipped, rescale, changed,
                      finished, why, origin)
