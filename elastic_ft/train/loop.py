"""The training run: resume, then steps until done, checkpointing as it goes.

One process per rank (torchrun starts them). Everything persisted or decided
is a function of the global step and cursor, never of RANK: ranks are re-dealt
at every restart, and the world may have changed size since the checkpoint.

The :class:`Trainer` composes the concepts that live in their own modules:
the world and its collectives (:mod:`~elastic_ft.train.world`), restoring from
a checkpoint (:mod:`~elastic_ft.train.restore`), step metrics
(:mod:`~elastic_ft.train.metrics`) and the background saver; what remains here
is the step itself, when to checkpoint, and the run from start to end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import socket
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from elastic_ft import faults, goodput
from elastic_ft.batch.identity import batch_node
from elastic_ft.checkpoint.cache import CachedStore
from elastic_ft.checkpoint.retention import RetentionPolicy, apply_gc, collect
from elastic_ft.checkpoint.store import join_uri, open_store
from elastic_ft.checkpoint.manifest import Manifest
from elastic_ft.checkpoint.saver import AsyncSaver, SaveFailed
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot, new_nonce, snapshot
from elastic_ft.config import JobSpec
from elastic_ft.events import EventLog, next_attempt
from elastic_ft.inputs.resolve import InputSource
from elastic_ft.spot.imds import endpoint_from_env
from elastic_ft.train import departure, precision
from elastic_ft.train import data as data_mod
from elastic_ft.train import model as model_mod
from elastic_ft.train.cadence import checkpoint_due
from elastic_ft.train.cursor import deal, take
from elastic_ft.train.guard import NonFiniteGuard
from elastic_ft.train.metrics import Metrics, StepResult, number
from elastic_ft.train.optim import build_adamw
from elastic_ft.train.preemption import Preemption
from elastic_ft.train.restore import Restorer, optimizer_tensors
from elastic_ft.train.resume import ResumePlan, plan_resume
from elastic_ft.train.scaling import lr_at, plan_batch, total_steps
from elastic_ft.train.world import (
    RunAborted, World, broadcast_from_leader, close_world, gather_from_all, init_world, sum_over_ranks,
)
from elastic_ft.viz.tensorboard import TensorBoardSink

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class RunOptions:
    run_id: str
    checkpoint_uri: str
    log_dir: str


class Trainer:
    """State of one training process; :meth:`run` is the whole job."""

    def __init__(self, spec: JobSpec, opts: RunOptions, world: World) -> None:
        self.spec, self.opts, self.world = spec, opts, world
        imds_endpoint = endpoint_from_env()  # a malformed one is a user error before any work
        precision.check_device(spec.precision, world.device)  # e.g. bfloat16 on a GPU without it
        self.plan = plan_batch(spec.batch, spec.optimizer.lr, world.size)
        events_path = os.path.join(opts.log_dir, "events.jsonl")
        # Every event names its attempt, so a step redone after a restart is told from its first try.
        attempt = broadcast_from_leader(world, next_attempt(events_path) if world.is_leader else None)
        self.events = EventLog(events_path if world.is_leader else None, run_id=opts.run_id, attempt=attempt)
        if spec.logging.tensorboard and world.is_leader:
            self.events.add_sink(TensorBoardSink(os.path.join(opts.log_dir, "tensorboard")))
        self.store = open_store(join_uri(opts.checkpoint_uri, opts.run_id), spec.checkpoint.store_settings())
        if spec.checkpoint.local_cache_dir is not None:
            self.store = CachedStore(self.store, os.path.join(spec.checkpoint.local_cache_dir, opts.run_id))
        with InputSource.from_spec(spec) as inputs:  # s3:// model and data: this node's cached copies
            self.tokenizer, self.model = model_mod.build(spec, inputs)
            self.data = data_mod.load(spec.data, self.tokenizer, inputs)
        self.model.to(world.device)
        self.total_steps = total_steps(spec.steps, spec.epochs, len(self.data), self.plan.global_batch)
        self.trainable = model_mod.trainable_state(self.model)
        self.param_names = {p: n for n, p in self.trainable.items()}
        self.optimizer = build_adamw(list(self.trainable.values()), lr=self.plan.lr, cfg=spec.optimizer)
        self.ddp = None
        if world.distributed:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(
                self.model, device_ids=[world.device.index] if world.device.type == "cuda" else None
            )
        self.step = 0
        self.cursor = 0
        # Background saves talk over their own gloo group, so their collectives
        # never interleave with the training thread's.
        # Its timeout bounds their waits as save_timeout_s bounds the training thread's.
        c = spec.checkpoint
        ckpt_group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=c.save_timeout_s))
                      if world.distributed else None)
        self.saver = AsyncSaver(
            CheckpointWriter(self.store, opts.run_id), rank=world.rank, world_size=world.size, group=ckpt_group,
            on_commit=self._on_commit, on_error=self._on_save_error, max_failed_saves=c.max_failed_saves,
            timeout_s=c.save_timeout_s,
        )
        self.guard = NonFiniteGuard(limit=spec.optimizer.max_nonfinite_steps)
        self.injector = faults.Injector.from_env()
        self.restorer = Restorer(world=world, store=self.store, run_id=opts.run_id, events=self.events,
                                 injector=self.injector)
        self._save_started: dict[int, tuple[float, float, str]] = {}  # step -> (start, blocked s, reason)
        self._save_lock = threading.Lock()
        # The spec does not change during a run; rendering and hashing it on every
        # save cost ~2 ms of blocked training time.
        self._spec_doc, self._config_hash = self.spec.to_dict(), self.spec.hash()
        self.last_ckpt_step = 0
        self.last_ckpt_time = time.monotonic()
        self.metrics = Metrics(world, self.events, total_steps=self.total_steps, every_steps=spec.logging.every_steps)
        # What the spot policy weighs (the committed step and commit time are the leader's: it decides).
        self.last_committed_step, self.last_commit_s, self.last_step_s = 0, None, None
        self.preemption = Preemption(spec.spot, world, self.events, endpoint=imds_endpoint)

    # ------------------------------------------------------------------ resume

    def resume(self) -> ResumePlan:
        """Load the newest verified checkpoint the leader chooses (see :class:`Restorer`); plan from it.

        Raises :class:`RunAborted` on every rank when no decision can be made
        or any rank failed to load the chosen checkpoint.
        """
        loaded, skipped = self.restorer.restore(
            spec_doc=self._spec_doc, model=self.model, trainable=self.trainable, optimizer=self.optimizer
        )
        if loaded is not None:
            self.step, self.cursor = loaded.manifest.step, loaded.manifest.cursor
            self.last_ckpt_step = self.last_committed_step = self.step
        plan = plan_resume(
            loaded.manifest if loaded else None, skipped, plan=self.plan, config_hash=self._config_hash,
            total_steps=self.total_steps,
        )
        self.events.emit("resume_plan", **plan.event())
        if plan.rescale is not None:
            self.events.emit("rescale", **plan.rescale)
        return plan

    # ------------------------------------------------------------------ steps

    def train_step(self) -> StepResult:
        w, plan, spec = self.world, self.plan, self.spec
        positions = take(self.cursor, plan.global_batch, len(self.data), spec.seed)
        indices = [i for _, i in positions]
        my_positions = deal(positions, plan.per_rank)[w.rank]
        mine = [i for _, i in my_positions]
        global_tokens = int(self.data.target_tokens[indices].sum())
        lr = lr_at(self.step, self.total_steps, plan.lr, spec.optimizer)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Dropout masks come from a stream reseeded per (seed, step, rank): no RNG
        # state has to survive a restart, and a resumed step repeats itself.
        torch.manual_seed(spec.seed * 1_000_003 + self.step * 7_919 + w.rank)
        # DDP averages gradients over ranks; scaling the summed token loss by
        # world/global_tokens makes the result sum(loss)/global_tokens: the same
        # gradient however the batch was split.
        scale = w.size / max(1, global_tokens)
        chunks = [mine[i : i + plan.micro_batch] for i in range(0, len(mine), plan.micro_batch)]
        net = self.ddp or self.model
        # Summed on the device: no host sync per micro-batch, and ready for the metrics' all-reduce.
        loss_sum = torch.zeros((), dtype=torch.float64, device=w.device)
        poison = self.injector.faults and self.injector.fires("nan_loss", rank=w.rank, step=self.step)
        for j, chunk in enumerate(chunks):
            last = j == len(chunks) - 1
            # One synchronised backward per step on every rank, however many micro-batches it has.
            sync = contextlib.nullcontext() if (last or self.ddp is None) else self.ddp.no_sync()
            batch = {k: v.to(w.device) for k, v in self.data.batch(chunk).items()}
            with sync:
                with precision.autocast(spec.precision, w.device):
                    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                # Shift the (small) labels left rather than slicing the (large) logits,
                # which would copy them: position t predicts token t+1.
                targets = F.pad(batch["labels"][:, 1:], (0, 1), value=data_mod.IGNORE)
                ce = F.cross_entropy(
                    logits.flatten(0, 1).float(), targets.flatten(), ignore_index=data_mod.IGNORE, reduction="sum",
                )
                if poison:
                    ce = ce * float("nan")
                (ce * scale).backward()
            loss_sum += ce.detach().double()
        skipped, grad_norm = self._update(loss_sum, global_tokens)
        consumed = None
        if spec.logging.ledger:
            # What each rank actually processed, gathered: the ledger proves the deal, not the plan.
            consumed = gather_from_all(w, my_positions)
        self.step += 1
        self.cursor += plan.global_batch
        if skipped is not None:
            self.events.emit(
                "step_skipped", step=self.step, reason=skipped, loss=number(float(loss_sum) / max(1, global_tokens)),
                grad_norm=number(grad_norm), in_row=self.guard.in_row, skipped_total=self.guard.total,
            )
            # Its loss is reported above, not in the step metrics.
            loss_sum = torch.zeros((), dtype=torch.float64, device=w.device)
            if self.guard.exhausted:
                self.metrics.flush()  # every rank is here: the guard's decision is the same on all
                raise self._abort(self.guard.abort_message(self.step))
        return StepResult(self.step, lr, global_tokens, consumed, loss_sum, skipped=skipped)

    def _update(self, loss_sum: torch.Tensor, global_tokens: int) -> tuple[str | None, float]:
        """Clip and apply the step's gradient unless its norm is not finite: (why it was skipped, the norm).

        The norm is taken after DDP's all-reduce, so it is the same number on
        every rank and every rank takes the same branch. Reading it is the one
        host sync this adds per step. A non-finite local loss makes its gradient
        non-finite too, so it is caught here on every rank; on that branch
        (taken by all) the loss is summed over ranks for the event.
        """
        params = list(self.trainable.values())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        grad_norm, local_loss = torch.stack([norm.double(), loss_sum]).tolist()  # the one host sync
        if not math.isfinite(grad_norm):
            sum_over_ranks(self.world, loss_sum)
            local_loss = float(loss_sum)
        reason = self.guard.observe(grad_norm, local_loss / max(1, global_tokens))
        if reason is None:
            if self.spec.optimizer.grad_clip is not None:
                torch.nn.utils.clip_grads_with_norm_(params, self.spec.optimizer.grad_clip, norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return reason, grad_norm

    def _abort(self, reason: str) -> RunAborted:
        """The error that stops the run, with its event (the caller raises it, on every rank alike)."""
        self.events.emit("aborted", step=self.step, reason=reason)
        return RunAborted(reason)

    # ------------------------------------------------------------------ checkpoints

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
        snap = snapshot(
            self.step, self.cursor,
            {"model": self.trainable, "optimizer": optimizer_tensors(self.optimizer, self.param_names)},
            documents={
                "trainer": {"step": self.step, "cursor": self.cursor, "total_steps": self.total_steps},
                "spec": self._spec_doc,
            },
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

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        w = self.world
        self.events.emit(
            "start", world=w.size, pid=os.getpid(), host=socket.gethostname(), total_steps=self.total_steps,
            dataset_size=len(self.data),
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), spec=self.spec.name,
            config_hash=self._config_hash, batch_plan=self.plan.to_dict(), **goodput.start_fields(),
            **({"node": node} if (node := batch_node()) else {}),  # array index, attempt on AWS Batch
        )
        self.resume()
        departure.announce(self.events, step=self.step, world=w.size, local_rank=w.local_rank)
        self.metrics.start()
        try:
            while self.step < self.total_steps:
                self.preemption.at_boundary(self)  # raises Preempted after committing, on a notice
                self._inject_faults()
                self.step_once()
                due, why = checkpoint_due(
                    step=self.step, total_steps=self.total_steps, last_step=self.last_ckpt_step,
                    seconds_since=time.monotonic() - self.last_ckpt_time, cfg=self.spec.checkpoint,
                )
                if self.spec.checkpoint.every_seconds is not None:
                    due, why = broadcast_from_leader(w, (due, why))  # clocks differ: the leader's decides
                if due:
                    self.save(why)
            self.metrics.flush()
            self.saver.flush()  # the final checkpoint is durable before the job reports success
        except SaveFailed as exc:  # the saver raises it on every rank alike (see AsyncSaver)
            raise self._abort(
                f"run {self.opts.run_id!r} stopped at step {self.step}: {exc}. A restarted job resumes from the "
                f"newest committed checkpoint"
            ) from exc
        summary = {"step": self.step, "final_loss": self.metrics.last_loss,
                   "seconds": round(time.monotonic() - self.metrics.t_start, 2)}
        self.events.emit("end", **summary)
        return summary

    def _inject_faults(self) -> None:
        """The test faults due at this step (ELASTIC_FT_FAULTS; see :mod:`elastic_ft.faults`)."""
        inj = self.injector
        if not inj.faults:
            return
        inj.maybe_fire(rank=self.world.rank, step=self.step)
        if inj.fires("nan_weight", rank=self.world.rank, step=self.step):
            with torch.no_grad():
                next(iter(self.trainable.values())).fill_(float("nan"))

    def step_once(self) -> StepResult:
        """One optimizer step, with its metrics reported every ``logging.every_steps`` steps."""
        t0 = time.monotonic()
        result = self.train_step()
        result.seconds = self.last_step_s = time.monotonic() - t0
        result.t_end = time.time()  # reported later, in a batch: the plot needs when it ended
        if self.world.is_leader:  # every step, reported or not yet: goodput needs the steps a kill cuts off too
            self.events.emit("step_done", quiet=True, step=result.step, seconds=round(result.seconds, 4))
        self.metrics.add(result)
        return result

    def close(self) -> None:
        self.preemption.close()
        self.saver.close()
        self.events.close()
        self.store.close()


def run(spec: JobSpec, opts: RunOptions) -> dict:
    """Run the job in this process (one rank of it under torchrun)."""
    world = init_world(datetime.timedelta(seconds=spec.spot.collective_timeout_s))
    try:
        trainer = Trainer(spec, opts, world)
        try:
            return trainer.run()
        finally:
            trainer.close()
    finally:
        # Also when the trainer cannot be built: exit_process takes a group still there for one
        # that a timed-out settle() left.
        close_world(world)  # bounded, also after a settle() that timed out
