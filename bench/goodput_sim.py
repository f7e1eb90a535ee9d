"""A discrete-event model of an elastic_ft run on a changing fleet, driven by the product's own decisions.

The model steps a run through a node availability trace
(:mod:`bench.goodput_traces`) with a cost table (:mod:`bench.goodput_costs`).
What happens at each point is decided by the product's pure functions,
imported here (never copied): the batch plan and so the step time
(:func:`elastic_ft.train.scaling.plan_batch`), when to save
(:func:`elastic_ft.train.cadence.checkpoint_due`), the response to a spot
notice and who leaves (:func:`elastic_ft.spot.policy.decide`,
:func:`~elastic_ft.spot.policy.leaving_nodes`) and where a restarted world
resumes (:func:`elastic_ft.train.resume.plan_resume`, given a manifest of the
model's last commit). Wall time is attributed to the categories of
``elastic-ft goodput`` (:data:`elastic_ft.runevents.goodput.CATEGORIES`) as
that command would from the run's events: a killed step's partial time and
waiting for nodes are ``restart``, as the gap between attempts is there.

Today's product restarts every worker on any change of membership and
resumes from the newest commit, so that is what is modelled; warm recovery
(issue 26) would change ``load_s``, ``worker_start_s`` and the resume source.

A node arriving after the start boots (``join_boot_s``: its agent starts
and joins the rendezvous) while the others train on; only then is it taken
into a round. Simplifications, each optimistic or neutral: all nodes alike;
a node booted during a recovery joins that round at no extra cost; a node
with a notice seen is left out of a round that forms before it goes. Cost: one
loop turn per step and per trace event.
"""

from __future__ import annotations

import dataclasses
import math

from elastic_ft.checkpoint.manifest import Manifest
from elastic_ft.config import BatchConfig, CheckpointConfig
from elastic_ft.runevents.goodput import CATEGORIES
from elastic_ft.spot.policy import PolicySettings, Situation, decide, leaving_nodes
from elastic_ft.spot.watcher import LEVEL_LEAVE, LEVEL_NONE
from elastic_ft.train.cadence import checkpoint_due
from elastic_ft.train.resume import plan_resume
from elastic_ft.train.scaling import plan_batch

from bench.goodput_costs import Costs
from bench.goodput_traces import NodeEvent

ENDLESS = 10**12
"""total_steps of the modelled run: it trains for the whole trace, so ``save_final`` never fires."""


@dataclasses.dataclass
class Result:
    seconds: dict[str, float]
    """Category -> seconds, summing to :attr:`wall` (the categories of ``elastic-ft goodput``)."""
    wall: float
    kept_steps: int
    tokens: float
    """Tokens of the steps kept."""
    node_seconds: float
    """Seconds of every node up in the trace (what a fleet is billed for)."""
    recoveries: list[dict]
    commits: int
    every_steps: int

    @property
    def goodput(self) -> float:
        return self.seconds["kept"] / self.wall if self.wall > 0 else 0.0


class Run:
    """One modelled run: the trace replayed against the costs, from t=0 to ``end``."""

    def __init__(self, trace: list[NodeEvent], costs: Costs, *, min_nodes: int, max_nodes: int, end: float,
                 every_steps: int | None = None, policy: PolicySettings | None = None) -> None:
        self.trace, self.costs, self.end = sorted(trace), costs, end
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.policy = policy or PolicySettings()
        self.every = every_steps or costs.every_steps
        self.cfg = CheckpointConfig(every_steps=self.every, every_seconds=None, save_final=True)
        gb = costs.global_batch or 2 * costs.micro_batch * max_nodes * costs.gpus_per_node
        self.batch = BatchConfig(global_batch=gb, micro_batch=costs.micro_batch, policy="constant_global")
        self._step_s: dict[int, float] = {}
        self.t, self.i = 0.0, 0  # the clock and the next trace event
        self.notice_queue = sorted((e.t - e.notice_s + costs.notice_poll_s, e.t, e.node) for e in self.trace
                                   if e.kind == "remove" and e.notice_s > 0)
        self.k = 0  # the next notice to be seen
        self.up: dict[str, float] = {}  # node -> when it went up
        self.booting: dict[str, float] = {}  # node arrived after the start -> when its agent has joined
        self.started = False  # the first start's costs include the first nodes' agent start
        self.notices: dict[str, tuple[float, float]] = {}  # node -> (notice seen, removal)
        self.world: frozenset[str] = frozenset()
        self.step = self.committed = self.saved = self.committed_world = 0
        self.upload: tuple[int, float] | None = None  # (step, when committed)
        self.t_saved = 0.0
        self.since_commit: list[tuple[int, float]] = []  # (step, seconds) trained after the newest commit
        self.seconds = {c: 0.0 for c in CATEGORIES}
        self.node_seconds, self.commits, self.recoveries = 0.0, 0, []
        self.plan = None

    # ----------------------------------------------------------------------------------------- plumbing

    def step_s(self, nodes: int) -> float:
        """One step at ``nodes`` nodes: the slowest rank's micro-batches of the product's batch plan."""
        if nodes not in self._step_s:
            plan = plan_batch(self.batch, 1.0, nodes * self.costs.gpus_per_node)
            self._step_s[nodes] = self.costs.micro_step_s * max(plan.micro_steps) + self.costs.step_sync_s
        return self._step_s[nodes]

    def advance(self, to: float, category: str) -> None:
        """Move the clock to ``to`` (not past the end), charging the time to ``category``."""
        to = min(to, self.end)
        if to > self.t:
            self.node_seconds += (to - self.t) * len(self.up)
            self.seconds[category] += to - self.t
            self.t = to
        self._settle()
        self._see_notices()

    def _settle(self) -> None:
        """An async upload that finished by now is committed."""
        if self.upload is not None and self.upload[1] <= self.t:
            self._commit(self.upload[0])
            self.upload = None

    def _commit(self, step: int) -> None:
        if step > self.committed:
            self.committed, self.commits, self.committed_world = step, self.commits + 1, len(self.world)
            self.since_commit = [(s, d) for s, d in self.since_commit if s > step]

    def next_event_t(self) -> float:
        return self.trace[self.i].t if self.i < len(self.trace) else math.inf

    def apply_events(self) -> list[str]:
        """Apply every trace event up to now; the world's nodes removed without a commit (a loss)."""
        lost = []
        while self.i < len(self.trace) and self.trace[self.i].t <= self.t:
            e = self.trace[self.i]
            self.i += 1
            if e.kind == "add":
                if e.node not in self.up and self.started:
                    self.booting[e.node] = e.t + self.costs.join_boot_s
                self.up.setdefault(e.node, e.t)
                continue
            self.up.pop(e.node, None)
            self.booting.pop(e.node, None)
            self.notices.pop(e.node, None)
            if e.node in self.world:
                lost.append(e.node)
        return lost

    def _see_notices(self) -> None:
        """Notices given by now, each seen one IMDS poll after it is served."""
        while self.k < len(self.notice_queue) and self.notice_queue[self.k][0] <= self.t:
            seen, gone, node = self.notice_queue[self.k]
            self.k += 1
            if node in self.up and gone > self.t:
                self.notices.setdefault(node, (seen, gone))

    def next_booted_t(self) -> float:
        """When the next booting node's agent has joined (a node waits for a round from then on)."""
        for node in [n for n, t in self.booting.items() if t <= self.t]:
            del self.booting[node]
        return min(self.booting.values(), default=math.inf)

    def eligible(self) -> list[str]:
        """Nodes a new round would take: up, booted, no notice seen, oldest first, at most ``max_nodes``."""
        ready = [n for n in self.up if n not in self.notices and self.booting.get(n, 0.0) <= self.t]
        return sorted(ready, key=lambda n: (self.up[n], n))[: self.max_nodes]

    # ------------------------------------------------------------------------------------------- phases

    def spend(self, seconds: float, category: str) -> bool:
        """Let ``seconds`` pass on ``category``, applying the trace; False (stopped there) when a node of the
        world (or of the round forming) was lost without a commit."""
        stop = self.t + seconds
        while self.next_event_t() <= min(stop, self.end):
            self.advance(self.next_event_t(), category)
            if self.apply_events():
                return False
        self.advance(stop, category)
        return True

    def recover(self, kind: str, segments: list[tuple[str, float]], reason: str = "") -> bool:
        """A restart of every worker: ``segments`` (category, seconds) in order, then the new world.

        False when a node of the forming round was lost meanwhile (the caller starts over, as a loss).
        """
        t0, record = self.t, {"kind": kind, "t": round(self.t, 3), "reason": reason}
        for category, seconds in segments:
            if not self.spend(seconds, category):
                self.recoveries.append({**record, "interrupted": True, "seconds": round(self.t - t0, 3)})
                return False
        self.world = frozenset(self.eligible())
        self.plan = plan_batch(self.batch, 1.0, len(self.world) * self.costs.gpus_per_node)
        self.recoveries.append({**record, "seconds": round(self.t - t0, 3), "world": len(self.world)})
        return True

    def start_world(self, kind: str) -> None:
        """Wait for ``min_nodes``, then (re)start; after a loss, from the newest commit (plan_resume)."""
        c = self.costs
        while self.t < self.end:
            self.world = frozenset()
            while len(self.eligible()) < self.min_nodes and self.t < self.end:
                self.advance(min(self.next_event_t(), self.next_booted_t()), "restart")
                self.apply_events()
            self.world = frozenset(self.eligible())  # the forming round
            if self.t >= self.end:
                return
            if kind == "start":
                segments, reason = [("restart", c.initial_restart_s), ("loading", c.initial_load_s)], "first start"
            else:
                reason = self.resume()
                segments = [("restart", c.detect_s + c.rendezvous_s), ("loading", c.worker_start_s + c.load_s)]
            if self.recover(kind, segments, reason):
                return
            kind = "loss"

    def resume(self) -> str:
        """Roll back to the newest commit as the product's resume plan says; the steps since become redone."""
        manifest = None
        if self.committed > 0:
            manifest = Manifest(run_id="model", step=self.committed, cursor=self.committed * self.batch.global_batch,
                                created=self.t, writer="model", config_hash="model", blobs={},
                                world={"size": self.committed_world * self.costs.gpus_per_node},
                                batch_plan=self.plan.to_dict() if self.plan else {})
        new_plan = plan_batch(self.batch, 1.0, max(1, len(self.world)) * self.costs.gpus_per_node)
        resume = plan_resume(manifest, [], plan=new_plan, config_hash="model", total_steps=ENDLESS)
        redone = [(s, d) for s, d in self.since_commit if s > resume.step]
        for _, d in redone:
            self.seconds["kept"] -= d
            self.seconds["redone"] += d
        self.since_commit, self.upload = [], None
        self.step = self.saved = resume.step
        self.recoveries.append({"kind": "rollback", "t": round(self.t, 3), "redone_steps": len(redone),
                                "resume_step": resume.step, "reason": resume.reason})
        return resume.reason

    # -------------------------------------------------------------------------------------------- steps

    def run(self) -> Result:
        self.apply_events()
        self.started = True
        self.start_world("start")
        while self.t < self.end:
            self.cruise()
            self.train_step()
        gb = self.batch.global_batch
        return Result(dict(self.seconds), self.t, self.step, self.step * gb * self.costs.tokens_per_sample,
                      self.node_seconds, self.recoveries, self.commits, self.every)

    def cruise(self) -> None:
        """Steps before the next trace event, notice or commit, where only the cadence can decide anything:
        what :meth:`train_step` would do one at a time, without its per-event bookkeeping (the model's hot
        loop: a week at 0.1 s steps is millions of them). Stops at the first step a save is due, after it."""
        if (self.notices and not self.world.isdisjoint(self.notices)) or self._may_join():
            return
        d = self.step_s(len(self.world))
        horizon = min(self.next_event_t(), self.next_booted_t(), self.end,
                      self.upload[1] if self.upload else math.inf,
                      self.notice_queue[self.k][0] if self.k < len(self.notice_queue) else math.inf)
        t, step, due = self.t, self.step, False
        while not due and t + d < horizon:
            t, step = t + d, step + 1
            self.since_commit.append((step, d))
            due, _ = checkpoint_due(step=step, total_steps=ENDLESS, last_step=self.saved,
                                    seconds_since=t - self.t_saved, cfg=self.cfg)
        self.node_seconds += (t - self.t) * len(self.up)
        self.seconds["kept"] += t - self.t
        self.t, self.step = t, step
        if due:
            self.boundary(d)

    def _may_join(self) -> bool:
        """Nodes wait that a round would take (the check first: it runs every step)."""
        if len(self.world) >= self.max_nodes or len(self.up) <= len(self.world):
            return False
        return any(n not in self.world for n in self.eligible())

    def train_step(self) -> None:
        """One step of the world, then its boundary; a node lost during the step ends it (its time: restart)."""
        d = self.step_s(len(self.world))
        begin, stop = self.t, self.t + d
        while self.next_event_t() <= min(stop, self.end):
            self.advance(self.next_event_t(), "kept")
            if self.apply_events():
                self.seconds["kept"] -= self.t - begin  # a killed attempt's unrecorded tail
                self.seconds["restart"] += self.t - begin
                return self.start_world("loss")
        self.advance(stop, "kept")
        if self.t >= self.end:
            return None
        self.step += 1
        self.since_commit.append((self.step, d))
        self.boundary(d)
        return None

    def boundary(self, step_s: float) -> None:
        """After a step: a save if due (checkpoint_due), then a notice's response (decide), else a join."""
        if not self.maybe_save():
            return self.start_world("loss")
        if self.notices and not self.world.isdisjoint(self.notices):  # (the check alone: it runs every step)
            reports = [(n, [LEVEL_LEAVE if n in self.notices else LEVEL_NONE]) for n in sorted(self.world)]
            return self.leave(leaving_nodes(reports), step_s)
        if self._may_join():
            return self.join()
        return None

    def maybe_save(self) -> bool:
        """An async save when ``checkpoint_due`` says so (waiting for one still uploading: if_busy wait)."""
        due, _ = checkpoint_due(step=self.step, total_steps=ENDLESS, last_step=self.saved,
                                seconds_since=self.t - self.t_saved, cfg=self.cfg)
        if not due:
            return True
        if self.upload is not None and not self.spend(self.upload[1] - self.t, "checkpoint"):
            return False
        if not self.spend(self.costs.ckpt_block_s, "checkpoint"):
            return False
        self.saved, self.t_saved = self.step, self.t
        self.upload = (self.step, self.t + self.costs.ckpt_upload_s)
        return True

    def leave(self, leaving: frozenset[str], step_s: float) -> None:
        """The product's response to a notice (decide); a leave commits, then the others restart without it."""
        c = self.costs
        situation = Situation(kind="terminate", deadline=min(self.notices[n][1] for n in leaving), now=self.t,
                              commit_s=c.commit_sync_s, steps_since_commit=self.step - self.committed,
                              in_flight_covers_step=self.upload is not None and self.upload[0] == self.step,
                              step_s=step_s)
        decision = decide(situation, self.policy)
        if not decision.leaves:
            return None
        wait = c.commit_sync_s if decision.action == "checkpoint_and_leave" else (
            self.upload[1] - self.t if self.upload else 0.0)
        if not self.spend(wait, "checkpoint"):  # the node went before its commit: a loss
            return self.start_world("loss")
        self.upload = None
        self._commit(self.step)
        segments = [("restart", c.leave_rendezvous_s), ("loading", c.worker_start_s + c.load_s)]
        self.world = frozenset(self.world - leaving)
        if not self.recover("leave", segments, decision.reason):
            self.start_world("loss")
        return None

    def join(self) -> None:
        """Nodes arrived: the running workers commit their step, then every worker restarts with them."""
        c = self.costs
        if self.step > self.committed:
            if not self.spend(c.commit_sync_s, "checkpoint"):
                return self.start_world("loss")
            self.upload = None
            self._commit(self.step)
        segments = [("restart", c.join_rendezvous_s), ("loading", c.worker_start_s + c.load_s + c.join_fetch_s)]
        if not self.recover("join", segments, "node(s) joined"):
            self.start_world("loss")
        return None


def simulate(trace: list[NodeEvent], costs: Costs, *, min_nodes: int = 1, max_nodes: int | None = None,
             end: float | None = None, every_steps: int | None = None,
             policy: PolicySettings | None = None) -> Result:
    """The run the trace and the costs make, from t=0 to ``end`` (default: the trace's last event).

    ``max_nodes`` defaults to the trace's peak; ``every_steps`` to the cost table's.
    """
    from bench.goodput_traces import duration, peak

    run = Run(trace, costs, min_nodes=min_nodes, max_nodes=max_nodes or max(1, peak(trace)),
              end=duration(trace) if end is None else end, every_steps=every_steps, policy=policy)
    return run.run()
