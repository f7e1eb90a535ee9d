"""The training run: resume, then steps until done, checkpointing as it goes.

One process per rank (torchrun starts them). Everything persisted or decided
is a function of the global step and cursor, never of RANK: ranks are re-dealt
at every restart, and the world may have changed size since the checkpoint.

The :class:`Trainer` composes the concepts that live in their own modules:
the world and its collectives (:mod:`~elastic_ft.train.world`), restoring from
a checkpoint (:mod:`~elastic_ft.train.restore`), step metrics
(:mod:`~elastic_ft.train.metrics`) and the checkpoints
(:mod:`~elastic_ft.train.saving`), each built by a step of
:mod:`~elastic_ft.train.build`; what remains here is the step itself, when to
checkpoint, and the run from start to end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import socket
import time

import torch

from elastic_ft.runevents import goodput
from elastic_ft.runevents.node_identity import batch_node
from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.save_errors import SaveFailed
from elastic_ft.config import JobSpec
from elastic_ft.runevents.events import joined_line
from elastic_ft.spot.imds import endpoint_from_env
from elastic_ft.train import faults, peer_loss, precision, rng, sharding
from elastic_ft.train import data as data_mod
from elastic_ft.train import loss as loss_mod
from elastic_ft.train import model as model_mod
from elastic_ft.train.build import (
    build_cached_store, build_checkpoints, build_evaluator, build_events, build_heldout, build_lease,
    build_model_and_data, build_preemption, build_store, commit_checks,
)
from elastic_ft.train.cadence import checkpoint_due
from elastic_ft.train.checkpoint_interval import AutoInterval
from elastic_ft.train.cursor import deal, take
from elastic_ft.train.micro_batches import micro_batches, step_tokens
from elastic_ft.train.guard import NonFiniteGuard
from elastic_ft.train.metrics import Metrics, StepResult, number
from elastic_ft.train.optim import build_adamw
from elastic_ft.train.saving import TrainedState
from elastic_ft.train.peer_state import PeerState
from elastic_ft.train.restore import Restorer
from elastic_ft.train import resuming
from elastic_ft.train.resume import ResumePlan
from elastic_ft.train.scaling import idle_note, lr_at, plan_batch, total_steps
from elastic_ft.train.world import (
    RunAborted, World, close_world, gather_from_all, init_world, sum_over_ranks,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class RunOptions:
    run_id: str
    checkpoint_uri: str
    log_dir: str


class Trainer:
    """State of one training process; :meth:`run` is the whole job, :meth:`close` (or ``with``) its end.

    Built by the steps of :mod:`elastic_ft.train.build`; one that fails closes what the steps before it
    opened, and the error propagates.
    """

    def __init__(self, spec: JobSpec, opts: RunOptions, world: World) -> None:
        self.spec, self.opts, self.world = spec, opts, world
        imds_endpoint = endpoint_from_env()  # a malformed one is a user error before any work
        precision.check_device(spec.precision, world.device)  # e.g. bfloat16 on a GPU without it
        sharding.check_world(spec.parallelism, world.size)  # at every restart: the world may have changed
        self.plan = plan_batch(spec.batch, spec.optimizer.lr, world.size)
        # The spec does not change during a run: rendered and hashed once (~2 ms per save otherwise).
        self._spec_doc, self._config_hash = spec.to_dict(), spec.hash()
        # The leader's console tells the run; each other node's local rank 0 tells how its node takes part.
        self.node_head = world.local_rank == 0 and not world.is_leader
        with contextlib.ExitStack() as opened:  # closes what was opened if a step below fails
            store = build_store(spec, opts.checkpoint_uri, opts.run_id, opened)
            # One live writer per run: a second job on this run is refused here, before it writes anything.
            self.lease = build_lease(world, store, opts.run_id, opened)
            self.events, self.shipper = build_events(spec, world, store, opts.log_dir, opts.run_id, opened,
                                                     node_head=self.node_head)
            self.store = build_cached_store(spec, store, opts.run_id)
            self.tokenizer, self.model, self.data = build_model_and_data(spec, world, self.store, opts.run_id)
            # With data.eval_fraction the cursor runs over the training side of the split only.
            self.data, self.eval_data = build_heldout(spec, world, self.store, opts.run_id, self.tokenizer, self.data)
            self.total_steps = total_steps(spec.steps, spec.epochs, len(self.data), self.plan.global_batch)
            # DDP's wrapper, or the model sharded in place (its parameters DTensors from here on).
            self.net = sharding.wrap(self.model, spec.parallelism, spec.precision, world.device, world.size,
                                     world.distributed)
            self.sharded = sharding.is_sharded(self.net)
            self.trainable = model_mod.trainable_state(self.model)
            self.params = list(self.trainable.values())  # what the optimizer steps; the step clips their gradients
            self.param_names = {p: n for n, p in self.trainable.items()}
            self.optimizer = build_adamw(self.params, lr=self.plan.lr, cfg=spec.optimizer)
            self.step = 0
            self.cursor = 0
            self.checkpoints = build_checkpoints(
                opened, spec=spec, world=world, store=self.store, run_id=opts.run_id, events=self.events,
                state=TrainedState(self.model, self.trainable, self.optimizer, self.param_names), plan=self.plan,
                total_steps=self.total_steps, spec_doc=self._spec_doc, config_hash=self._config_hash,
                before_commit=commit_checks(self.lease, self.shipper) if world.is_leader else None,
            )
            self.guard = NonFiniteGuard(limit=spec.optimizer.max_nonfinite_steps)
            self.injector = faults.Injector.from_env()
            self.restorer = Restorer(world=world, store=self.store, run_id=opts.run_id, events=self.events,
                                     injector=self.injector)
            # Each completed step kept node-locally (checkpoint.keep_step_in_memory), for the resume after a
            # membership change; closed (the write in flight finished) with the rest on an error.
            self.peers = PeerState(world, run_id=opts.run_id, config_hash=self._config_hash,
                                   enabled=spec.checkpoint.keep_step_in_memory, strategy=spec.parallelism.strategy,
                                   events=self.events)
            opened.callback(self.peers.close, ended=False)
            self._kept_fields: dict | None = None
            self.metrics = Metrics(world, self.events, total_steps=self.total_steps,
                                   every_steps=spec.logging.every_steps, each_step=self.peers.active)
            self.last_step_s: float | None = None  # what the spot policy weighs, with the checkpoints' record
            self.preemption = build_preemption(spec, world, self.events, imds_endpoint, opened)
            self.evaluator = build_evaluator(spec, world, self.events, self.eval_data)
            self.auto = AutoInterval(spec.checkpoint, leader=world.is_leader, events=self.events)  # every_steps: auto
            self._resources = opened.pop_all()

    # What the spot response reads (elastic_ft.train.preemption.Trainer) and the run's cadence: the
    # checkpoints' record (the committed step and commit time are the leader's: it decides).

    @property
    def saver(self) -> AsyncSaver:
        return self.checkpoints.saver

    @property
    def last_ckpt_step(self) -> int:
        return self.checkpoints.last_step

    @property
    def last_committed_step(self) -> int:
        return self.checkpoints.committed.step

    @property
    def last_commit_s(self) -> float | None:
        return self.checkpoints.committed.seconds

    def save(self, reason: str, *, sync: bool = False) -> None:
        """Checkpoint the current step on every rank (see :meth:`Checkpoints.save`)."""
        self.metrics.flush()  # the events of every step a checkpoint covers are written first
        evaluated = self.evaluator.record_for(self.step) if self.evaluator is not None else {}
        self.checkpoints.save(reason, step=self.step, cursor=self.cursor, sync=sync, evaluated=evaluated)
        if self.checkpoints.last_step == self.step:  # submitted: its commit ships the events of its steps
            self.metrics.records.clear()

    # ------------------------------------------------------------------ resume

    def resume(self) -> ResumePlan:
        """Resume from a node's kept step or the newest verified checkpoint (:func:`resuming.resume`)."""
        return resuming.resume(self)

    # ------------------------------------------------------------------ steps

    @property
    def _flat(self) -> bool:
        """Whether packed rows go to the model as one unpadded row per micro-batch (flash-attention's layout)."""
        return self.data.packed and loss_mod.padding_free(self.model)

    def train_step(self) -> StepResult:
        w, plan, spec = self.world, self.plan, self.spec
        positions = take(self.cursor, plan.global_batch, len(self.data), spec.seed)
        indices = [i for _, i in positions]
        my_positions = deal(positions, plan.per_rank)[w.rank]
        mine = [i for _, i in my_positions]
        global_tokens = self.data.target_count(indices)
        lr = lr_at(self.step, self.total_steps, plan.lr, spec.optimizer)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Dropout masks come from a stream reseeded per (seed, step, rank): no RNG
        # state has to survive a restart, and a resumed step repeats itself.
        # (rng.reseed: torch.manual_seed's streams without its per-call cost on backends this rank does not use)
        rng.reseed(spec.seed * 1_000_003 + self.step * 7_919 + w.rank, w.device)
        # DDP and FSDP average gradients over ranks; scaling the summed token loss by
        # world/global_tokens makes the result sum(loss)/global_tokens: the same
        # gradient however the batch was split.
        scale = w.size / max(1, global_tokens)
        chunks = micro_batches(mine, plan.micro_batch, self.data.micro_lengths(mine))
        net = self.net
        # The micro-batches' losses stay on the device (no host sync per micro-batch), summed once below.
        losses: list[torch.Tensor] = []
        poison = self.injector.faults and self.injector.fires("nan_loss", rank=w.rank, step=self.step)
        # FSDP all-gathers every layer in each forward: all ranks run as many micro-batches (see lockstep);
        # under DDP a rank dealt nothing (plan.idle_ranks) still runs one, at weight 0, for the all-reduce.
        count = max(plan.micro_steps) if self.sharded else max(1, len(chunks))
        for j, (chunk, weight) in enumerate(sharding.lockstep(chunks, count, filler=indices[:1])):
            last = j == count - 1
            batch = data_mod.to_device(self.data.batch(chunk, flat=self._flat), w.device)  # pinned, asynchronous on CUDA
            # One synchronised backward per step on every rank, however many micro-batches it has.
            with sharding.gradient_sync(net, last):
                ce = loss_mod.summed_loss(net, self.model, batch, chunk_tokens=spec.model.loss_chunk_tokens,
                                          autocast=lambda: precision.autocast(spec.precision, w.device))
                if poison:
                    ce = ce * float("nan")
                (ce * (scale * weight)).backward()
            if weight:  # lockstep's repeats (weight 0) add nothing to the loss
                losses.append(ce.detach())
        # In float64, on the device: ready for the metrics' all-reduce (zero on a rank that sat the step out).
        loss_sum = (torch.stack(losses).sum(dtype=torch.float64) if losses
                    else torch.zeros((), dtype=torch.float64, device=w.device))
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
        return StepResult(self.step, lr, global_tokens, consumed, loss_sum, skipped=skipped,
                          **step_tokens(self.data, indices, plan, flat=self._flat))

    def _update(self, loss_sum: torch.Tensor, global_tokens: int) -> tuple[str | None, float]:
        """Clip and apply the step's gradient unless its norm is not finite: (why it was skipped, the norm).

        The norm is taken after DDP's all-reduce (of FSDP's shards: their global
        norm), so it is the same number on every rank and every rank takes the same branch. Reading it is the one
        host sync this adds per step. A non-finite local loss makes its gradient
        non-finite too, so it is caught here on every rank; on that branch
        (taken by all) the loss is summed over ranks for the event.
        """
        params = self.params
        norm = sharding.total_norm([p.grad for p in params if p.grad is not None])
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
        if self.node_head:
            log.info("%s", joined_line(self.opts.run_id, w.rank, w.local_size, w.size, self.events.common["attempt"]))
        if self.plan.idle_ranks and w.is_leader:  # a join never ends the run: the ranks beyond the batch wait
            log.warning("batch: %s", idle_note(self.plan.idle_ranks, w.size, self.plan.global_batch))
        plan = self.resume()
        self.auto.start(self.store, self.events.common["attempt"], time.time())  # the leader reads the run's losses
        peer_loss.announce(self.events, step=self.step, world=w.size, local_rank=w.local_rank,
                           source=f"kept in memory by node {plan.origin.node}" if plan.from_memory
                           else "the last committed")
        self.metrics.start()
        first = True
        try:
            while self.step < self.total_steps:
                # Raises Preempted after committing, on a notice. The leader's checkpoint clock and interval
                # (every_steps: auto) are agreed in the same all-reduce: the same step saves on every rank.
                age = self.preemption.at_boundary(self, interval=self.auto.propose(
                    time.time(), self.last_step_s, self.checkpoints.last_blocked_s), checkpoint_age_s=None if
                    self.spec.checkpoint.every_seconds is None else time.monotonic() - self.checkpoints.last_time)
                self.auto.adopt(self.preemption.agreed_interval, step=self.step)
                # The evaluation of a resumed step that a notice stopped before: done first. Abandoned on a
                # notice: back to the boundary (it agrees at once) to leave, not on to the next step.
                if not self._evaluate():
                    continue
                self._inject_faults()
                self.step_once()
                if first and self.node_head:  # the leader's progress lines say the rest
                    log.info("training: step %d/%d done at world %d; progress lines are on the node of rank 0",
                             self.step, self.total_steps, w.size)
                first = False
                self._evaluate()  # before the step's checkpoint, whose manifest records it
                due, why = checkpoint_due(step=self.step, total_steps=self.total_steps, last_step=self.last_ckpt_step,
                                          seconds_since=age, cfg=self.spec.checkpoint, auto_steps=self.auto.steps)
                if due:
                    self.save(why)
            while self.evaluator is not None and self.evaluator.due(self.step, self.total_steps):
                # The last step's evaluation was abandoned on a notice: the boundary agrees on it at once and
                # leaves (committing this step; the resume evaluates it), or _evaluate leaves.
                self.preemption.at_boundary(self)
                self._evaluate()
            self.metrics.flush()
            self.saver.flush()  # the final checkpoint is durable before the job reports success
            self.peers.close(ended=True)  # nothing resumes from this node's kept step any more
        except SaveFailed as exc:  # the saver raises it on every rank alike (see AsyncSaver)
            raise self._abort(
                f"run {self.opts.run_id!r} stopped at step {self.step}: {exc}. A restarted job resumes from the "
                f"newest committed checkpoint"
            ) from exc
        summary = {"step": self.step, "final_loss": self.metrics.last_loss,
                   "seconds": round(time.monotonic() - self.metrics.t_start, 2)}
        self.events.emit("end", **summary)
        return summary

    def _evaluate(self) -> bool:
        """Evaluate the current step if it is due; False when a notice abandoned it (on every rank), the next
        boundary then agreeing at once, so the leave waits for neither. Under a leave notice the ranks agreed
        on (trained on by ``spot.train_until_deadline``) it is not started, as it would be abandoned at each
        try: the step is committed and the run leaves now (:class:`Preempted`); the resume evaluates it."""
        ev = self.evaluator
        if ev is None or not ev.due(self.step, self.total_steps):
            return True
        if self.preemption.leave_standing:
            self.preemption.leave_now(self, f"the evaluation of step {self.step} cannot finish under the notice; "
                                            f"it is done after the resume")
        self.metrics.flush()  # the step events before the evaluation's
        done = ev.run(self.step, model=self.model, forward=self.net if self.sharded else self.model,
                      sharded=self.sharded, poll=self.preemption.poll())
        if done is None:
            self.preemption.agree_next()
        return done is not None

    def _inject_faults(self) -> None:
        """The test faults due at this step (ELASTIC_FT_FAULTS; see :mod:`elastic_ft.train.faults`)."""
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
        done = {"step": result.step, "seconds": round(result.seconds, 4)}
        if self.world.is_leader:  # every step, reported or not yet: goodput needs the steps a kill cuts off too
            self.events.emit("step_done", quiet=True, **done)
        if self.metrics.each_step:
            self.metrics.record("step_done", done)
        self.metrics.add(result)  # its events first: a resume from the kept step needs every step before it
        resuming.keep_step(self)  # node-local, for the resume after a membership change
        return result

    def close(self, error: BaseException | None = None) -> None:
        """Close what the build opened, last first: the spot watcher, the checkpoints, the events, the store.

        ``error``: the run ends on it (see :func:`~elastic_ft.train.build.ends_on_error`); the save in
        flight is then given up rather than waited for, so this takes seconds. Closing twice does nothing.
        """
        resources, self._resources = self._resources, contextlib.ExitStack()
        if error is None:
            resources.close()
        else:
            resources.__exit__(type(error), error, error.__traceback__)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)


def run(spec: JobSpec, opts: RunOptions) -> dict:
    """Run the job in this process (one rank of it under torchrun)."""
    world = init_world(datetime.timedelta(seconds=spec.spot.collective_timeout_s))
    try:
        with Trainer(spec, opts, world) as trainer:  # closed also when it cannot be built whole
            return trainer.run()
    finally:
        # Also when the trainer cannot be built: exit_process takes a group still there for one
        # that a timed-out settle() left.
        close_world(world)  # bounded, also after a settle() that timed out
