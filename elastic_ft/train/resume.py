"""The resume plan: where a (re)started run continues, decided by a pure function.

Inputs are what the leader found in the store (the newest verified manifest
and the checkpoints skipped on the way) and the world at hand; the output is
the step and cursor to continue from, the rescale since the checkpoint, and a
reason, all logged as one event.
"""

from __future__ import annotations

import dataclasses

from elastic_ft.checkpoint.manifest import Manifest
from elastic_ft.checkpoint.reader import Skipped
from elastic_ft.train.scaling import BatchPlan, rescale_event


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    step: int
    cursor: int
    source: str | None
    """Manifest key resumed from (None: fresh start)."""
    skipped: list[Skipped]
    rescale: dict | None
    config_changed: bool
    finished: bool
    reason: str

    def event(self) -> dict:
        return {
            "step": self.step, "cursor": self.cursor, "source": self.source,
            "skipped": [dataclasses.asdict(s) for s in self.skipped], "config_changed": self.config_changed,
            "finished": self.finished, "reason": self.reason,
        }


def plan_resume(manifest: Manifest | None, skipped: list[Skipped], *, plan: BatchPlan, config_hash: str,
                total_steps: int) -> ResumePlan:
    if manifest is None:
        why = "no committed checkpoint: starting from step 0"
        if skipped:
            why = (f"every committed checkpoint failed verification ({len(skipped)} retired to quarantine/): "
                   f"starting from step 0")
        return ResumePlan(0, 0, None, skipped, None, False, False, why)
    changed = manifest.config_hash != config_hash
    rescale = rescale_event(manifest.batch_plan or None, plan)
    finished = manifest.step >= total_steps
    why = f"resuming from step {manifest.step} (cursor {manifest.cursor}) saved at world {manifest.world.get('size')}"
    if skipped:
        why += f", after retiring {len(skipped)} newer unusable checkpoint(s) to quarantine/"
    if changed:
        why += "; the spec's training settings changed since that checkpoint"
    if finished:
        why += f"; the run is already complete ({total_steps} steps)"
    return ResumePlan(manifest.step, manifest.cursor, manifest.key, skipped, rescale, changed, finished, why)
