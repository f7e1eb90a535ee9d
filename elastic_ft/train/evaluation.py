"""Evaluation: the token-weighted loss of the held-out samples over every rank, abandoned on a spot notice.

Which samples: the first ``eval.max_samples`` held-out samples in store order,
cut into fixed micro-batches of ``batch.micro_batch`` samples by their position
(:func:`eval_chunks`), never by rank. The micro-batches are dealt round-robin
to the ranks (:func:`rank_chunks`). Since a micro-batch's samples, and so its
padding and shapes, are the same at any world size, its summed loss is the same
number wherever it is computed; the sums are taken in float64 on the process
group's device, with the token count, and reduced in one all-reduce. The value
at step S therefore depends on the weights at S only, not on the world size or
on the preemptions before S (up to float64 rounding of the final sum).

The model runs in eval mode (no dropout) without autograd; under DDP the bare
module runs (the wrapper would broadcast buffers per forward), under FSDP the
sharded one, every rank as many forwards (zero-weight repeats, as in training).
Between micro-batches the ranks agree whether any has a spot notice
(:class:`~elastic_ft.train.preemption.NoticePoll`); on one the evaluation is
abandoned on every rank, an ``eval_abandoned`` event says how far it got, and
the caller leaves at the next step boundary. Which step was evaluated travels
in the checkpoint's manifest (``eval``), so a resume at a step whose
evaluation did not finish does it first; that redone evaluation is then
carried by every later manifest as a late record
(:data:`~elastic_ft.checkpoint.retention.LATE`), where ``keep_best`` finds it
by its step.

Cost per evaluation: ``max_samples / world`` samples' forward passes per rank
(about a third of a training step's compute per sample), one small all-reduce
per micro-batch and one at the end; nothing that grows with the training data.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from elastic_ft.checkpoint.retention import LATE, MAX_LATE, late_records
from elastic_ft.runevents.events import EventLog
from elastic_ft.train import loss as loss_mod
from elastic_ft.train.data import to_device
from elastic_ft.train.metrics import number
from elastic_ft.train.world import World

log = logging.getLogger(__name__)


def due(step: int, total_steps: int, every_steps: int | None) -> bool:
    """Whether the step that just ended (``step`` steps done) is evaluated: every ``every_steps``, and the last."""
    return every_steps is not None and step > 0 and (step % every_steps == 0 or step == total_steps)


def eval_chunks(samples: int, micro_batch: int) -> list[list[int]]:
    """The held-out positions ``0 .. samples - 1`` cut into micro-batches of ``micro_batch``, in order."""
    return [list(range(i, min(samples, i + micro_batch))) for i in range(0, samples, micro_batch)]


def rank_chunks(chunks: int, rank: int, size: int) -> list[int]:
    """The micro-batches (by number) rank ``rank`` of ``size`` evaluates: every ``size``-th from ``rank``."""
    return list(range(rank, chunks, size))


@dataclasses.dataclass(frozen=True)
class EvalResult:
    step: int
    loss: float
    """Summed token cross-entropy over every rank / tokens: the mean loss per target token."""
    tokens: int
    samples: int
    seconds: float

    def record(self) -> dict:
        """What a checkpoint's manifest keeps of it (``Manifest.eval``): retention reads the loss there."""
        loss = self.loss if math.isfinite(self.loss) else None  # strict JSON; retention skips it
        return {"step": self.step, "loss": loss, "tokens": self.tokens, "samples": self.samples}


class Evaluator:
    """Evaluates the model on ``data`` (a store or :class:`~elastic_ft.train.heldout.SampleView` of the
    held-out samples) every ``every_steps``; one per rank, called by every rank alike."""

    def __init__(self, data, *, every_steps: int | None, max_samples: int, micro_batch: int, world: World,
                 events: EventLog, chunk_tokens: int | None, autocast: Callable[[], ContextManager]) -> None:
        self.data, self.every_steps, self.world, self.events = data, every_steps, world, events
        self.samples = min(len(data), max_samples)
        self.chunks = eval_chunks(self.samples, micro_batch)
        self.mine = rank_chunks(len(self.chunks), world.rank, world.size)
        self.count = -(-len(self.chunks) // world.size)  # the busiest rank's micro-batches: every rank polls as often
        self.chunk_tokens, self.autocast = chunk_tokens, autocast
        self.done_step: int | None = None
        """The step whose evaluation is done (this attempt's, or the resumed checkpoint's)."""
        self.last: EvalResult | None = None
        self.late: list[dict] = []
        """Evaluations of steps committed without them (:data:`LATE`), for every later checkpoint's manifest."""
        self._unrecorded: int | None = None  # the resumed step, when its checkpoint holds no evaluation of it

    def due(self, step: int, total_steps: int) -> bool:
        return due(step, total_steps, self.every_steps) and self.done_step != step

    def record_for(self, step: int) -> dict:
        """What the manifest of ``step``'s checkpoint records: the evaluation of ``step`` ({} when it was not
        evaluated), and the late records (:data:`LATE`) when there are any."""
        own = self.last.record() if self.last is not None and self.last.step == step else {}
        return {**own, LATE: list(self.late)} if self.late else own

    def resumed(self, record: dict, step: int) -> None:
        """The run resumed from a checkpoint of ``step`` whose manifest holds ``record``."""
        if record.get("step") == step:
            self.done_step = step
        else:  # evaluated after the resume (if due): a late record from then on
            self._unrecorded = step
        self.late = late_records(record)

    def run(self, step: int, *, model: torch.nn.Module, forward: torch.nn.Module, sharded: bool,
            poll) -> EvalResult | None:
        """Evaluate the weights of ``step``; None when a notice stopped it (on every rank alike).

        ``model``: the (PEFT) model, put in eval mode and back; ``forward``: what runs the forward (the bare
        module under DDP, the sharded model under FSDP); ``poll``: a :class:`NoticePoll`.
        """
        w = self.world
        t0 = time.monotonic()
        self.events.emit("eval_started", quiet=True, step=step, samples=self.samples, micro_batches=len(self.chunks),
                         per_rank=self.count)
        total = torch.zeros((), dtype=torch.float64, device=w.device)
        tokens = 0
        was_training = model.training
        model.eval()
        done = 0
        try:
            with torch.no_grad():
                for j in range(self.count):
                    mine = j < len(self.mine)
                    if mine or sharded:  # FSDP all-gathers in every forward: every rank runs as many
                        chunk = self.chunks[self.mine[j] if mine else 0]
                        batch = to_device(self.data.batch(chunk), w.device)
                        ce = loss_mod.summed_loss(forward, model, batch, chunk_tokens=self.chunk_tokens,
                                                  autocast=self.autocast)
                        if mine:
                            total += ce.double()
                            tokens += self.data.target_count(chunk)
                    # The previous micro-batch's poll is read once this one is queued (see NoticePoll).
                    if j and poll.standing():
                        self.events.emit("eval_abandoned", step=step, per_rank_done=done, per_rank=self.count,
                                         reason="a spot notice to leave")
                        return None
                    done = j + 1
                    poll.post()
                poll.drain()
            both = torch.stack([total, torch.tensor(float(tokens), dtype=torch.float64, device=w.device)])
            if w.distributed:
                dist.all_reduce(both)
            loss_sum, token_count = both.tolist()  # the one host sync of the evaluation
        finally:
            model.train(was_training)
        count = int(round(token_count))
        result = EvalResult(step=step, loss=loss_sum / max(1, count), tokens=count, samples=self.samples,
                            seconds=time.monotonic() - t0)
        self.done_step, self.last = step, result
        if step == self._unrecorded:
            late = [r for r in self.late if r["step"] != step] + [{"step": step, "loss": result.record()["loss"]}]
            # The lowest losses are the ones keep_best can pick (None, not finite: last).
            self.late = sorted(late, key=lambda r: (r["loss"] is None, r["loss"] or 0.0, r["step"]))[:MAX_LATE]
        self.events.emit("eval", step=step, loss=number(result.loss), tokens=count, samples=self.samples,
                         seconds=round(result.seconds, 4))
        return result


__all__ = ["EvalResult", "Evaluator", "due", "eval_chunks", "rank_chunks"]
