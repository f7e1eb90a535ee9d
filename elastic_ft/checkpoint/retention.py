"""Retention and garbage collection, planned by a pure function.

:func:`plan_gc` takes what is in the store (manifests with the blobs they
reference, and every blob object with its age) and the policy, and returns
what to delete with a reason for each. :func:`apply_gc` carries a plan out:
manifests first (a checkpoint stops existing the moment its manifest goes),
then blobs, so a crash half-way leaves only orphans that the next gc collects.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from elastic_ft.checkpoint.manifest import BLOB_PREFIX
from elastic_ft.checkpoint.store import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

RANGES: dict[str, tuple[float, float]] = {"keep_last": (1, 10**6), "keep_every": (1, 10**9),
                                          "orphan_grace_s": (0.0, 1e8)}
"""Each field's closed range. The spec's ``checkpoint.*`` limits (``config.LIMITS``) are these: one table,
here, since the config layer sits above the checkpoint layer."""


def _out_of_range(name: str, value: float) -> str | None:
    lo, hi = RANGES[name]
    if lo <= value <= hi:  # False for nan too
        return None
    shown = f"<a number {value.bit_length()} bits long>" if isinstance(value, int) and value.bit_length() > 64 \
        else repr(value)
    return f"{name} must be in [{lo}, {hi}], got {shown}"


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """What gc keeps. Raises ValueError naming the field for a value outside the
    range (:data:`RANGES`): a negative ``keep_last`` once deleted every
    checkpoint but the newest."""

    keep_last: int | None = 3
    """Newest committed checkpoints to keep, at least 1 (None keeps all)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (at least 1)."""
    orphan_grace_s: float = 3600.0
    """Blobs referenced by no manifest are deleted only once older than this
    (a save in flight has blobs but no manifest yet); finite, >= 0."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest eval loss (:func:`best_step`)."""

    def __post_init__(self) -> None:
        problems = [p for name in RANGES if (v := getattr(self, name)) is not None and (p := _out_of_range(name, v))]
        if problems:
            raise ValueError("retention policy: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class Deletion:
    key: str
    reason: str


@dataclasses.dataclass(frozen=True)
class GcPlan:
    manifests: list[Deletion]
    blobs: list[Deletion]
    kept_steps: list[int]

    def lines(self) -> list[str]:
        out = [f"keep checkpoints at steps {self.kept_steps}"]
        out += [f"delete {d.key}  ({d.reason})" for d in self.manifests + self.blobs]
        return out


def best_step(eval_losses: dict[int, float | None]) -> int | None:
    """The step of the lowest finite eval loss in ``eval_losses`` (step -> loss, None: not evaluated); the
    earliest of equal ones (it was reached first); None when no checkpoint has one."""
    scored = [(loss, step) for step, loss in eval_losses.items()
              if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)]
    return min(scored)[1] if scored else None


LATE = "late"
"""The key, in a manifest's ``eval``, of evaluations of earlier steps whose checkpoints were committed without
them: ``[{"step", "loss"}]``. An evaluation abandoned on a spot notice commits its step unevaluated and is
redone after the resume; the checkpoints after it carry its record forward, so that ``keep_best`` and
``export --best`` find it by the step it evaluated, whatever retention has deleted since."""

MAX_LATE = 64
"""Late records a manifest carries at most (the lowest losses): one per resume that redid an evaluation."""


def _loss(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def eval_loss(manifest) -> float | None:
    """The eval loss a manifest records for its own step (``Manifest.eval``), or None."""
    record = manifest.eval or {}
    loss = _loss(record.get("loss"))
    return loss if record.get("step") == manifest.step else None


def late_records(record: dict) -> list[dict]:
    """The well-formed late records (:data:`LATE`) of a manifest's ``eval`` (it comes from storage: anything
    else in it is skipped), as ``{"step", "loss"}``."""
    late = record.get(LATE) if isinstance(record, dict) else None
    return [{"step": r["step"], "loss": _loss(r.get("loss"))} for r in (late if isinstance(late, list) else [])
            if isinstance(r, dict) and isinstance(r.get("step"), int) and not isinstance(r["step"], bool)
            and r["step"] > 0]


def eval_losses(manifests) -> dict[int, float | None]:
    """The eval loss of each evaluated step that ``manifests`` record, by the step it evaluated: each
    manifest's own step's (:func:`eval_loss`) and the late ones (:data:`LATE`) it carries."""
    out: dict[int, float | None] = {}
    for m in manifests:
        for r in late_records(m.eval or {}):
            out.setdefault(r["step"], r["loss"])
        if (own := eval_loss(m)) is not None:
            out[m.step] = own
    return out


def plan_gc(
    manifests: dict[int, tuple[str, set[str]]],
    blobs: list[ObjectInfo],
    policy: RetentionPolicy,
    now: float,
    eval_losses: dict[int, float | None] | None = None,
) -> GcPlan:
    """Decide what to delete.

    ``manifests`` maps step -> (manifest key, keys of the blobs it references);
    ``blobs`` lists every object under ``blobs/``. The newest checkpoint is
    always kept, whatever the policy holds (even one that bypassed
    validation: keep_last 0 or negative), and no blob referenced by a kept
    manifest is ever deleted. ``eval_losses`` (step -> the eval loss recorded
    for it, None where none: :func:`eval_losses`): with ``policy.keep_best``
    the step of the lowest among the checkpoints (:func:`best_step`) is kept too.
    """
    steps = sorted(manifests)
    # Not steps[-keep_last:]: with keep_last=0 that slice is the whole list (keep all).
    keep: set[int] = set(steps if policy.keep_last is None else steps[max(0, len(steps) - policy.keep_last) :])
    if steps:
        keep.add(steps[-1])  # defensive: the one checkpoint a resume can always use
    if policy.keep_every and policy.keep_every > 0:
        keep |= {s for s in steps if s % policy.keep_every == 0}
    best = best_step({s: (eval_losses or {}).get(s) for s in steps}) if policy.keep_best else None
    if best is not None:
        keep.add(best)
    drop_manifests = [
        Deletion(manifests[s][0], f"step {s} is past retention (keep_last={policy.keep_last}, "
                                  f"keep_every={policy.keep_every}" + (f", best={best}" if policy.keep_best else "")
                                  + ")")
        for s in steps if s not in keep
    ]
    referenced_by_kept = set().union(*(manifests[s][1] for s in keep)) if keep else set()
    referenced_by_dropped = set().union(*(manifests[s][1] for s in steps if s not in keep)) if steps else set()
    drop_blobs = []
    for obj in blobs:
        if not obj.key.startswith(BLOB_PREFIX) or obj.key in referenced_by_kept:
            continue
        if obj.key in referenced_by_dropped:
            drop_blobs.append(Deletion(obj.key, "referenced only by deleted checkpoints"))
        elif now - obj.mtime >= policy.orphan_grace_s:
            drop_blobs.append(Deletion(obj.key, f"orphan (no manifest), {now - obj.mtime:.0f}s old"))
    return GcPlan(drop_manifests, drop_blobs, sorted(keep))


def collect(store: ObjectStore, policy: RetentionPolicy, now: float, *, run_id: str | None = None) -> GcPlan:
    """Read the store and plan its gc (reads only)."""
    from elastic_ft.checkpoint.reader import list_manifests, read_manifest
    from elastic_ft.checkpoint.manifest import ManifestCorrupt, step_of_key

    manifests = {}
    read = []
    for info in list_manifests(store):
        try:
            m = read_manifest(store, info.key, run_id=run_id, size=info.size)
        except ManifestCorrupt as exc:
            # Not a checkpoint (resume retires it): gc leaves the file alone; its blobs count as orphans.
            log.warning("gc skips a corrupt manifest: %s", exc)
            continue
        manifests[step_of_key(info.key)] = (info.key, {b.key for b in m.blobs.values()})
        read.append(m)
    return plan_gc(manifests, store.list(BLOB_PREFIX), policy, now, eval_losses(read))


def apply_gc(store: ObjectStore, plan: GcPlan) -> None:
    for d in plan.manifests:
        store.delete(d.key)
    for d in plan.blobs:
        store.delete(d.key)
