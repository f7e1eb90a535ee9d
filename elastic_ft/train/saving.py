"""The run's checkpoints: a snapshot of the current step submitted to the background saver, and what the
leader does once its manifest is committed (the event, retention) or the save failed.

:class:`Checkpoints` owns the saver, its process group and the record of saves (which step was saved
last and when, which committed last and how long it took); the trainer hands it the step and cursor
to save and reads that record. Commits are reported by the saver's callback into this object, on the
saver's thread, never into the trainer.

Cost per save: one broadcast (skip-if-busy and the blob nonce) and the host copy of the trainable
state (grows with the trainable parameters and optimizer state, not with the dataset or the node
count); the upload runs in the background, each rank uploading ``1/world`` of it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import socket
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from elastic_ft.checkpoint.manifest import Manifest
from elastic_ft.checkpoint.retention import RetentionPolicy, apply_gc, collect
from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot, new_nonce, snapshot
from elastic_ft.config import JobSpec
from elastic_ft.runevents.events import EventLog
from elastic_ft.train import dcp_state
from elastic_ft.train.restore import optimizer_tensors
from elastic_ft.train.scaling import BatchPlan
from elastic_ft.train.world import World, broadcast_from_leader

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainedState:
    """What a checkpoint holds of the training: the model, its trainable tensors and the optimizer."""

    model: torch.nn.Module
    trainable: dict[str, torch.Tensor]
    """Trainable parameters by name (as the model names them)."""
    optimizer: torch.optim.Optimizer
    param_names: dict[torch.Tensor, str]
    """Each trainable parameter's name: optimizer state is saved keyed by it (stable across restarts)."""


@dataclasses.dataclass(frozen=True)
class Committed:
    """The newest committed checkpoint this rank knows of (the leader's is the one that decides)."""

    step: int = 0
    seconds: float | None = None
    """How long its save took, from the step boundary to the manifest (None: none committed this attempt)."""


class Checkpoints:
    """Saves of one run on one rank (see :meth:`save`); :meth:`close` ends them."""

    def __init__(self, *, spec: JobSpec, world: World, store: ObjectStore, run_id: str, events: EventLog,
                 state: TrainedState, plan: BatchPlan, total_steps: int, spec_doc: dict, config_hash: str,
                 before_commit: Callable[[Snapshot], None] | None = None) -> None:
        self.spec, self.world, self.store, self.run_id, self.events = spec, world, store, run_id, events
        self.state, self.plan, self.total_steps = state, plan, total_steps
        # The spec does not change during a run; rendering and hashing it on every
        # save cost ~2 ms of blocked training time.
        self.spec_doc, self.config_hash = spec_doc, config_hash
        c = spec.checkpoint
        # Background saves talk over their own gloo group, so their collectives
        # never interleave with the training thread's.
        # Its timeout bounds their waits as save_timeout_s bounds the training thread's.
        self.group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=c.save_timeout_s))
                      if world.distributed else None)
        self._started: dict[int, tuple[float, float, str]] = {}  # step -> (start, blocked s, reason)
        self._lock = threading.Lock()
        self.last_step = 0
        """The newest step a save was submitted for (in flight or committed)."""
        self.last_time = time.monotonic()
        """When that save was submitted (monotonic)."""
        self.last_blocked_s: float | None = None
        """How long the last save this rank made at the run's cadence blocked training (an async save's host
        copy and its wait for the upload before it; a synchronous one's whole time): the commit cost that
        ``checkpoint.every_steps: auto`` weighs (the leader's)."""
        self.committed = Committed()
        """Replaced whole by the saver's thread at each commit (one assignment: read without a lock)."""
        self.saver = AsyncSaver(
            CheckpointWriter(store, run_id), rank=world.rank, world_size=world.size, group=self.group,
            on_commit=self._on_commit, on_error=self._on_error, max_failed_saves=c.max_failed_saves,
            before_commit=before_commit, timeout_s=c.save_timeout_s,
        )

    def resumed(self, step: int) -> None:
        """The run resumed from the checkpoint of ``step``: it counts as saved and committed."""
        self.last_step = step
        self.committed = Committed(step, self.committed.seconds)

    def save(self, reason: str, *, step: int, cursor: int, sync: bool = False, evaluated: dict | None = None) -> None:
        """Checkpoint ``step``: every rank snapshots and uploads its shard.

        Called on every rank at the same steps. Training blocks for the host
        copy only, unless ``sync`` (or ``checkpoint.async_save: false``).
        A failed save is an event, and the run goes on, until
        ``checkpoint.max_failed_saves`` failed in a row: then the saver raises
        :class:`~elastic_ft.checkpoint.save_errors.SaveFailed` here (on every rank
        alike; the run stops). ``sync`` raises on any failure: the caller needs the checkpoint.
        ``evaluated``: the evaluation of ``step`` (:meth:`EvalResult.record`) and the late records of earlier
        steps (:meth:`Evaluator.record_for`), kept in the manifest, where retention (``checkpoint.keep_best``)
        and a resume read them; {} or None when there are none.
        """
        t0 = time.monotonic()
        cfg = self.spec.checkpoint
        # The leader decides skip-if-busy and the blob nonce, so all ranks submit the same saves.
        skip, nonce = broadcast_from_leader(self.world, (cfg.if_busy == "skip" and self.saver.busy and not sync,
                                                         new_nonce()))
        if skip:
            self.events.emit("checkpoint_skipped", step=step, reason="the previous save is still uploading")
            return
        tensors, documents, sharded = self._host_state()
        snap = snapshot(
            step, cursor, tensors,
            documents={
                "trainer": {"step": step, "cursor": cursor, "total_steps": self.total_steps},
                "spec": self.spec_doc, **documents,
            },
            sharded=sharded,
            config_hash=self.config_hash,
            world={"size": self.world.size, "host": socket.gethostname()},
            rng={"scheme": "reseed(seed, step, rank) before each step", "seed": self.spec.seed},
            scheduler={"name": self.spec.optimizer.schedule, "step": step, "total_steps": self.total_steps,
                       "peak_lr": self.plan.lr},
            batch_plan=self.plan.to_dict(),
            eval=dict(evaluated or {}),
        )
        if sync or not cfg.async_save:
            self._started[step] = (t0, float("nan"), reason)
            self.saver.submit(snap, nonce)
            if sync:
                self.saver.flush()
            else:
                self.saver.wait()
                self.last_blocked_s = time.monotonic() - t0
        else:
            # Waiting for a save still in flight (if_busy=wait) is part of the blocked
            # time. The lock keeps a fast commit's _on_commit (which pops this entry)
            # from running before the entry is written: it would report blocked_s
            # as None and leave a stale entry behind.
            self.saver.wait()
            with self._lock:
                self.saver.submit(snap, nonce)
                self.last_blocked_s = time.monotonic() - t0
                self._started[step] = (t0, self.last_blocked_s, reason)
        self.last_step, self.last_time = step, time.monotonic()

    def _host_state(self) -> tuple[dict, dict, dict | None]:
        """(replicated tensors, extra documents, sharded state) of this step's trainable state, host copies.

        ddp: every rank holds all of it; the ranks upload a share each of the tensors (the fast path).
        fsdp: each rank holds its shards, saved through torch.distributed.checkpoint (resharded at load);
        the optimizer's param groups, not tensors, go in a document.
        """
        st = self.state
        if self.spec.parallelism.strategy != "fsdp":
            return ({"model": st.trainable, "optimizer": optimizer_tensors(st.optimizer, st.param_names)}, {}, None)
        from elastic_ft.checkpoint.sharded import stage

        state, groups = dcp_state.trainable_state(st.model, st.optimizer)
        return {}, {"optimizer": {"param_groups": groups}}, stage(state)

    def _on_commit(self, manifest: Manifest, snap: Snapshot) -> None:
        """Leader, after a manifest landed (on the saver's thread)."""
        with self._lock:
            t0, blocked, reason = self._started.pop(snap.step, (time.monotonic(), float("nan"), ""))
        seconds = time.monotonic() - t0
        self.committed = Committed(max(self.committed.step, snap.step), seconds)
        self.events.emit(
            "checkpoint_committed", step=snap.step, key=self.store.join(manifest.key), bytes=manifest.total_size,
            parts=self.world.size, blocked_s=None if math.isnan(blocked) else round(blocked, 5),
            seconds=round(seconds, 4), reason=reason,
        )
        c = self.spec.checkpoint
        if c.keep_last is not None:
            policy = RetentionPolicy(keep_last=c.keep_last, keep_every=c.keep_every, orphan_grace_s=c.orphan_grace_s,
                                     keep_best=c.keep_best)
            try:
                apply_gc(self.store, collect(self.store, policy, time.time(), run_id=self.run_id))
            except Exception as exc:  # retention can wait for the next commit; the checkpoint is safe
                log.warning("retention after step %d failed: %s", snap.step, exc)

    def _on_error(self, snap: Snapshot, exc: BaseException) -> None:
        with self._lock:
            self._started.pop(snap.step, None)
        self.events.emit("checkpoint_failed", step=snap.step, error=f"{type(exc).__name__}: {exc}",
                         in_row=self.saver.failed_in_row, limit=self.spec.checkpoint.max_failed_saves)

    def close(self, *, abandon: bool = False) -> None:
        """Stop the saver and leave its process group.

        ``abandon`` (the run ends on an error): the save in flight is given up, so this takes seconds
        (see :meth:`AsyncSaver.close`); otherwise it is waited for and commits. The group is left even
        when an abandoned thread still waits in one of its collectives: gloo's shutdown does not wait
        for it, and the thread's collective then fails.
        """
        self.saver.close(abandon=abandon)
        if self.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except (RuntimeError, ValueError) as exc:  # already gone with the default group: nothing to leave
                log.debug("checkpoint group: %s", exc)
            self.group = None

