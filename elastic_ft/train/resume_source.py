"""Where a (re)started world resumes from: a node's kept step, or the newest committed checkpoint.

A pure decision (no I/O, no collectives): its inputs are what every rank of the new
world reports its node holds (:class:`Held`, or None) and the newest committed
checkpoint's step; its output the source with a reason, which the resume event
carries. The reports travel as one fixed-size int64 row per rank
(:func:`encode` / :func:`decode`), so the exchange is one small all-gather whatever
the state's size; the decision costs O(ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

REPORT_WIDTH = 4
"""int64 fields per rank in the exchange: (holds, step, identity, node)."""

MEMORY = "memory"
CHECKPOINT = "checkpoint"


@dataclasses.dataclass(frozen=True)
class Held:
    """What one rank reports its node keeps: the step and the state's identity (run and config)."""

    step: int
    identity: int
    node: int
    """The node's group rank in the new world (torchrun's GROUP_RANK), for the event."""


@dataclasses.dataclass(frozen=True)
class ResumeSource:
    kind: str
    """:data:`MEMORY` or :data:`CHECKPOINT` (which checkpoint, if any, the restorer then chooses)."""
    reason: str
    rank: int | None = None
    """The rank that sends the state (memory only)."""
    node: int | None = None
    """The holder's node (its group rank in the new world; memory only)."""
    step: int | None = None
    """The step resumed from memory (memory only)."""
    committed_step: int | None = None
    """The newest committed step the decision weighed (None: none, or not read)."""
    host: str | None = None
    """The holder's host name, once its state arrived (memory only)."""

    def event(self) -> dict:
        out: dict = {"origin": self.kind, "origin_reason": self.reason}
        if self.kind == MEMORY:
            out["holder"] = {"rank": self.rank, "node": self.node, "step": self.step, "host": self.host}
        out["committed_step"] = self.committed_step
        return out


def encode(held: Held | None) -> list[int]:
    """A rank's report as :data:`REPORT_WIDTH` ints (all zero: holds nothing)."""
    if held is None:
        return [0] * REPORT_WIDTH
    return [1, held.step, held.identity, held.node]


def decode(row: Sequence[int]) -> Held | None:
    holds, step, identity, node = (int(x) for x in row)
    return Held(step, identity, node) if holds else None


def choose_source(reports: Sequence[Held | None], *, committed_step: int | None, identity: int,
                  enabled: bool = True, strategy: str = "ddp") -> ResumeSource:
    """The resume source of a new world, from each rank's report (index = rank) and the newest commit.

    Memory when a rank's node holds a state of this run and config (``identity``) at a step not older than
    ``committed_step`` (None: nothing committed): the newest such step, the lowest rank holding it. At the
    committed step itself memory is chosen too: the same state, sent over the group instead of read from
    the store by every rank. Otherwise the checkpoint, saying why: keeping is off; ``fsdp`` (each rank holds
    only its shards, so a lost node takes part of the state); no
    node holds anything (a first start, a whole-job restart: the nodes are new); the held states are of
    another run or config; or they are older than the newest commit.
    """
    if not enabled:
        return ResumeSource(CHECKPOINT, "checkpoint.keep_step_in_memory is off")
    if strategy == "fsdp":
        return ResumeSource(CHECKPOINT, "parallelism.strategy fsdp: each rank holds only its shards, so a lost "
                                        "node takes part of the state with it; no node keeps a whole state")
    held = [(h, rank) for rank, h in enumerate(reports) if h is not None]
    if not held:
        return ResumeSource(CHECKPOINT, "no node of this world holds a kept step (a first start, or every node "
                                        "is new)")
    ours = [(h, rank) for h, rank in held if h.identity == identity]
    if not ours:
        return ResumeSource(CHECKPOINT, f"the {len(held)} kept state(s) belong to another run or training config")
    best, rank = max(ours, key=lambda hr: (hr[0].step, -hr[1]))
    if committed_step is not None and best.step < committed_step:
        return ResumeSource(CHECKPOINT, f"the newest kept step {best.step} is older than the newest commit "
                                        f"(step {committed_step})", committed_step=committed_step)
    newer = ("nothing is committed" if committed_step is None
             else f"the newest commit is step {committed_step}")
    return ResumeSource(MEMORY, f"node {best.node} holds step {best.step} in memory; {newer}",
                        rank=rank, node=best.node, step=best.step, committed_step=committed_step)
