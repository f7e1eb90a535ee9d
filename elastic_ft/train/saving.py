"""The trainer's checkpoints: a snapshot of the current step submitted to the background saver, and what the
leader does once its manifest is committed (the event, retention) or the save failed.

A mixin of :class:`~elastic_ft.train.loop.Trainer`, whose state (step, cursor, trainable tensors,
optimizer, saver, events, store) it reads; kept apart so the training step and the run's course are
read without the bookkeeping of saves.
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
import threading
import time

import torch.distributed as dist

from elastic_ft.checkpoint.manifest import Manifest
from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.retention import RetentionPolicy, apply_gc, collect
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot, new_nonce, snapshot
from elastic_ft.train import dcp_state
from elastic_ft.train.restore import optimizer_tensors
from elastic_ft.train.world import broadcast_from_leader

log = logging.getLogger(__name__)


class Saving:
    """Checkpoint methods of the trainer (see :meth:`save`)."""

    def _open_saver(self) -> AsyncSaver:
        """The background saver, and the state the saves keep (called once, from the trainer's constructor)."""
        world, c = self.world, self.spec.checkpoint
        # Background saves talk over their own gloo group, so their collectives
        # never interleave with the training thread's.
        # Its timeout bounds their waits as save_timeout_s bounds the training thread's.
        ckpt_group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=c.save_timeout_s))
                      if world.distributed else None)
        self._save_started: dict[int, tuple[float, float, str]] = {}  # step -> (start, blocked s, reason)
        self._save_lock = threading.Lock()
        # The spec does not change during a run; rendering and hashing it on every
        # save cost ~2 ms of blocked training time.
        self._spec_doc, self._config_hash = self.spec.to_dict(), self.spec.hash()
        self.last_ckpt_step = 0
        self.last_ckpt_time = time.monotonic()
        return AsyncSaver(
            CheckpointWriter(self.store, self.opts.run_id), rank=world.rank, world_size=world.size, group=ckpt_group,
            on_commit=self._on_commit, on_error=self._on_save_error, max_failed_saves=c.max_failed_saves,
            before_commit=self._before_commit if world.is_leader else None,
            timeout_s=c.save_timeout_s,
        )

    def _before_commit(self, snap: Snapshot) -> None:
        """Leader, between a checkpoint's blobs and its manifest: still the run's writer (else
        :class:`~elastic_ft.checkpoint.lease.LeaseLost`, which stops the run), then the events shipped."""
        if self.lease is not None:
            self.lease.check()
        if self.shipper is not None:
            self.shipper.before_commit(snap)

    def save(self, reason: str, *, sync: bool = False) -> None:
        """Checkpoint the current step: every rank snapshots and uploads its shard.

        Called on every rank at the same steps. Training blocks for the host
        copy only, unless ``sync`` (or ``checkpoint.async_save: false``).
        A failed save is an event, and the run goes on, until
        ``checkpoint.max_failed_saves`` failed in a row: then the saver raises
        :class:`SaveFailed` here (on every rank alike; :meth:`run` stops the
        run). ``sync`` raises on any failure: the caller needs the checkpoint.
        """
        self.metrics.flush()  # the events of every step a checkpoint covers are written first
        t0 = time.monotonic()
        cfg = self.spec.checkpoint
        # The leader decides skip-if-busy and the blob nonce, so all ranks submit the same saves.
        skip, nonce = broadcast_from_leader(self.world, (cfg.if_busy == "skip" and self.saver.busy and not sync,
                                                         new_nonce()))
        if skip:
            self.events.emit("checkpoint_skipped", step=self.step, reason="the previous save is still uploading")
            return
        tensors, documents, state = self._state()
        snap = snapshot(
            self.step, self.cursor, tensors,
            documents={
                "trainer": {"step": self.step, "cursor": self.cursor, "total_steps": self.total_steps},
                "spec": self._spec_doc, **documents,
            },
            sharded=state,
            config_hash=self._config_hash,
            world={"size": self.world.size, "host": socket.gethostname()},
            rng={"scheme": "reseed(seed, step, rank) before each step", "seed": self.spec.seed},
            scheduler={"name": self.spec.optimizer.schedule, "step": self.step, "total_steps": self.total_steps,
                       "peak_lr": self.plan.lr},
            batch_plan=self.plan.to_dict(),
        )
        if sync or not cfg.async_save:
            self._save_started[self.step] = (t0, float("nan"), reason)
            self.saver.submit(snap, nonce)
            if sync:
                self.saver.flush()
            else:
                self.saver.wait()
        else:
            # Waiting for a save still in flight (if_busy=wait) is part of the blocked
            # time. The lock keeps a fast commit's _on_commit (which pops this entry)
            # from running before the entry is written: it would report blocked_s
            # as None and leave a stale entry behind.
            self.saver.wait()
            with self._save_lock:
                self.saver.submit(snap, nonce)
                self._save_started[self.step] = (t0, time.monotonic() - t0, reason)
        self.last_ckpt_step, self.last_ckpt_time = self.step, time.monotonic()

    def _state(self) -> tuple[dict, dict, dict | None]:
        """(replicated tensors, extra documents, sharded state) of this step's trainable state, host copies.

        ddp: every rank holds all of it; the ranks upload a share each of the tensors (the fast path).
        fsdp: each rank holds its shards, saved through torch.distributed.checkpoint (resharded at load);
        the optimizer's param groups, not tensors, go in a document.
        """
        if self.spec.parallelism.strategy != "fsdp":
            return ({"model": self.trainable, "optimizer": optimizer_tensors(self.optimizer, self.param_names)},
                    {}, None)
        from elastic_ft.checkpoint.sharded import stage

        state, groups = dcp_state.trainable_state(self.model, self.optimizer)
        return {}, {"optimizer": {"param_groups": groups}}, stage(state)

    def _on_commit(self, manifest: Manifest, snap: Snapshot) -> None:
        """Leader, after a manifest landed (on the saver's thread)."""
        with self._save_lock:
            t0, blocked, reason = self._save_started.pop(snap.step, (time.monotonic(), float("nan"), ""))
        self.last_committed_step = max(self.last_committed_step, snap.step)
        self.last_commit_s = time.monotonic() - t0
        self.events.emit(
            "checkpoint_committed", step=snap.step, key=self.store.join(manifest.key), bytes=manifest.total_size,
            parts=self.world.size, blocked_s=None if math.isnan(blocked) else round(blocked, 5),
            seconds=round(time.monotonic() - t0, 4), reason=reason,
        )
        c = self.spec.checkpoint
        if c.keep_last is not None:
            policy = RetentionPolicy(keep_last=c.keep_last, keep_every=c.keep_every, orphan_grace_s=c.orphan_grace_s)
            try:
                apply_gc(self.store, collect(self.store, policy, time.time(), run_id=self.opts.run_id))
            except Exception as exc:  # retention can wait for the next commit; the checkpoint is safe
                log.warning("retention after step %d failed: %s", snap.step, exc)

    def _on_save_error(self, snap: Snapshot, exc: BaseException) -> None:
        self._save_started.pop(snap.step, None)
        self.events.emit("checkpoint_failed", step=snap.step, error=f"{type(exc).__name__}: {exc}",
                         in_row=self.saver.failed_in_row, limit=self.spec.checkpoint.max_failed_saves)
