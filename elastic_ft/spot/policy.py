"""The response to a notice at a step boundary: a pure function of the situation, with the clock passed in.

Actions:

- ``checkpoint_and_leave``: commit the current step synchronously, then exit.
- ``flush_and_leave``: the current step is already saved (committed, or in
  the asynchronous save still in flight): wait for that save, then exit.
- ``early_checkpoint``: a rebalance recommendation (the instance is at
  elevated risk, no deadline yet): commit now, keep training.
- ``none``: nothing to do at this boundary.

Leaving at the first boundary is the default: in a multi-node job the
survivors re-form sooner, and a notice's two minutes are better spent by
them than by a node that could be cut off mid-commit. ``train_until_deadline``
trades that for more steps on this node when its deadline is known.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from elastic_ft.spot.watcher import LEAVE_KINDS, LEVEL_LEAVE

ACTIONS = ("checkpoint_and_leave", "flush_and_leave", "early_checkpoint", "none")
LEAVING = ("checkpoint_and_leave", "flush_and_leave")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySettings:
    on_rebalance: str = "checkpoint"
    """checkpoint: an early checkpoint per recommendation; ignore: nothing."""
    train_until_deadline: bool = False
    """Keep training while another step and a commit fit before a known deadline."""
    margin_s: float = 10.0
    """Time kept in hand before the deadline (with ``train_until_deadline``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Situation:
    kind: str | None
    """The most urgent notice any rank has (see :data:`LEAVE_KINDS`, or rebalance); None: no notice."""
    deadline: float | None
    """When the node goes (epoch seconds); None when unknown."""
    now: float
    """Epoch seconds."""
    commit_s: float | None
    """How long the last commit took (None before the first)."""
    steps_since_commit: int
    """Steps trained since the newest committed checkpoint."""
    in_flight_covers_step: bool
    """The asynchronous save in flight is of the current step."""
    step_s: float | None
    """Duration of a recent step (None before the first)."""
    rebalance_handled: bool = False
    """This rebalance recommendation was already answered."""


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str
    reason: str

    @property
    def leaves(self) -> bool:
        return self.action in LEAVING


def decide(s: Situation, settings: PolicySettings) -> Decision:
    """What ``s`` calls for. Raises ValueError for an unknown notice kind (the watcher makes none)."""
    if s.kind is None:
        return Decision("none", "no notice")
    if s.kind in LEAVE_KINDS:
        return _leave(s, settings)
    if s.kind != "rebalance":
        raise ValueError(f"unknown notice kind {s.kind!r}")
    if settings.on_rebalance == "ignore":
        return Decision("none", "rebalance recommendation ignored (spot.on_rebalance: ignore)")
    if s.rebalance_handled:
        return Decision("none", "this rebalance recommendation was already answered")
    if s.in_flight_covers_step or s.steps_since_commit == 0:
        return Decision("none", "rebalance recommendation: the current step is already saved; checkpoint "
                                "after the next step")
    return Decision("early_checkpoint",
                    f"rebalance recommendation: checkpoint the {s.steps_since_commit} step(s) since the last commit")


def _leave(s: Situation, settings: PolicySettings) -> Decision:
    left = None if s.deadline is None else s.deadline - s.now
    if settings.train_until_deadline and left is not None and s.commit_s is not None and s.step_s is not None:
        needed = s.step_s + s.commit_s + settings.margin_s
        if left > needed:
            return Decision("none", f"{s.kind}: {left:.0f} s left, another step and a commit need {needed:.1f} s "
                                    f"(spot.train_until_deadline)")
    if s.in_flight_covers_step:
        return Decision("flush_and_leave", f"{s.kind}: the save in flight covers the current step; flush it")
    if s.steps_since_commit == 0:
        return Decision("flush_and_leave", f"{s.kind}: nothing trained since the last commit")
    return Decision("checkpoint_and_leave", f"{s.kind}: commit {s.steps_since_commit} step(s) now; "
                                            f"{_fit(left, s.commit_s)}")


def _fit(left: float | None, commit_s: float | None) -> str:
    """A note on whether the commit should finish in time (it is attempted either way: it is the only chance)."""
    if left is None:
        return "deadline unknown"
    if left <= 0:
        return f"the deadline passed {-left:.0f} s ago"
    if commit_s is None:
        return f"{left:.0f} s left, commit time not measured yet"
    verdict = "should fit" if commit_s < left else "may not fit"
    return f"{left:.0f} s left, the last commit took {commit_s:.1f} s: {verdict}"


def leaving_nodes(reports: Iterable[tuple[str, Iterable[int]]]) -> frozenset[str]:
    """The nodes that leave: those where any rank holds a notice of level ``leave``.

    ``reports`` holds one ``(node, notice levels)`` per rank; ``node`` is the
    rank's ``GROUP_RANK`` (its agent's rank in the round). A notice reaches
    every process of a node (each polls IMDS; the agent forwards SIGTERM), but
    not at the same instant: one rank's is enough.
    """
    return frozenset(node for node, levels in reports if any(level >= LEVEL_LEAVE for level in levels))
