"""A Spot availability trace replayed on the real stack: its goodput measured, and predicted by the goodput model.

The validation of bench/goodput_model.py (issue 27): a segment of a node
availability trace (CSV ``ms,add|remove,node``, e.g. the 32-node p3.2xlarge
trace at ../shared/traces/p3-spot-32.csv, read from its path, never copied)
is folded onto the chaos cluster's few nodes (tests/chaos/cluster.py:
heterogeneous torchrun agents on etcd3, the tiny spec, file:// checkpoints),
compressed in time, and played: a ``remove`` SIGKILLs the node's whole tree
(a reclaim without notice: the trace records no notices, and the calibration
measures the costs of a kill), an ``add`` starts the node again (a new
instance, whose agent then joins the running job).
The run's goodput is the product's own (``elastic-ft goodput``: the run's
events through :func:`elastic_ft.runevents.goodput.attribute`); the model
runs on the same folded, compressed segment with the costs a calibration run
measured on this machine just before (one start, a kill and the node's
return, on the same cluster): both are printed by category with their
difference.

Folding (``fold``): the trace's node ``nodeN`` is cluster node ``(N - 1) mod
K``; a remove takes that node down if it is up, an add brings it up if it is
down, and every other event is merged away (an add to a node that is up, a
remove of one that is down). The fleet's rate of changes is kept (on the
p3 trace at 32 nodes nearly every change is a restart of the whole job, as it
is on K nodes), not its size. Nodes up at the segment's start are ``add``
events at 0 ms. Compression (``compress``): every time divided by one factor,
at most ``--factor`` (6: a trace minute in 10 s) and less where the start the
calibration measured needs it (``fitting_factor``: the first change comes after
the run has started and trained a few steps; on a loaded machine the start
takes a minute or more); the factor used is printed. The bench's default
segment (``busiest_start``) is the window of ``--minutes`` with the most
changes, none in its first six minutes and some node always up.

    python bench/trace_replay.py --trace ../shared/traces/p3-spot-32.csv [--start-min M] [--minutes 30]
                                 [--factor 6] [--nprocs 1,2,1] [--json] [--keep]
    python bench/trace_replay.py --synthetic          # the test's segment, generated here

Cost: every restart of the replay costs what a restart costs on this machine
(10-25 s of process start and imports on 2 cores, far more under load); the
replay's wall time is the segment's length over the factor, plus one
calibration run (about a minute idle, four under a load of 20).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.chaos.cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TRACE_ENV = "ELASTIC_FT_TRACE"
"""The environment variable naming a trace file (the real p3 trace) for the test and the bench."""
ACTIONS = ("add", "remove")
WAIT_S = 240.0  # any single wait of the calibration: far above a healthy recovery on a loaded 2-core machine
NPROCS = (1, 2, 1)
EVERY_STEPS = 5  # a commit to resume from soon after the start, even at a loaded machine's 5 s steps
GLOBAL_BATCH, MICRO_BATCH = 32, 8  # specs/tiny-lora.yaml's batch, which the cluster trains


class TraceError(ValueError):
    """A trace that cannot be read: the message is one line naming the file, the line and what to do."""


@dataclasses.dataclass(frozen=True)
class Change:
    ms: int
    action: str
    node: str


# ------------------------------------------------------------------------------------------------ traces (pure)


def parse_trace(text: str, source: str = "trace") -> list[Change]:
    """The changes of a trace CSV (``ms,add|remove,node`` a line; a header line and blank lines skipped), in
    time order (stable: changes at the same ms keep the file's order). Raises TraceError naming the line."""
    out = []
    for n, row in enumerate(csv.reader(io.StringIO(text)), 1):
        if not row or not "".join(row).strip() or (n == 1 and not row[0].strip().isdigit()):
            continue
        if len(row) != 3:
            raise TraceError(f"{source}:{n}: expected 'ms,add|remove,node', got {','.join(row)!r}")
        ms, action, node = (x.strip() for x in row)
        if not ms.isdigit():
            raise TraceError(f"{source}:{n}: the time {ms!r} is not a whole number of milliseconds")
        if action not in ACTIONS:
            raise TraceError(f"{source}:{n}: the action {action!r} is not 'add' or 'remove'")
        if not node:
            raise TraceError(f"{source}:{n}: the node is empty")
        out.append(Change(int(ms), action, node))
    return sorted(out, key=lambda c: c.ms)


def read_trace(path: str) -> list[Change]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise TraceError(f"--trace {path}: cannot be read ({exc.strerror}); give the path of a CSV "
                         f"'ms,add|remove,node'") from None
    return parse_trace(text, path)


def to_csv(changes: list[Change]) -> str:
    return "".join(f"{c.ms},{c.action},{c.node}\n" for c in changes)


def slot_of(node: str, slots: int) -> int:
    """The cluster node a trace node folds onto: ``nodeN`` -> (N - 1) mod ``slots`` (any other name: by its
    digits, else by a stable hash of the name)."""
    digits = "".join(ch for ch in node if ch.isdigit())
    number = int(digits) - 1 if digits else sum(node.encode())
    return number % slots


def fold(changes: list[Change], slots: int, start_ms: int = 0, end_ms: int | None = None) -> list[Change]:
    """The segment [start_ms, end_ms) of a fleet's trace, folded onto ``slots`` nodes named node0.. (see the
    module's docstring), times from the segment's start; the nodes up at its start are adds at 0 ms."""
    up = [False] * slots
    out: list[Change] = []
    for c in changes:
        if end_ms is not None and c.ms >= end_ms:
            break
        s = slot_of(c.node, slots)
        if up[s] == (c.action == "add"):
            continue  # merged: the folded node is already in that state
        up[s] = c.action == "add"
        if c.ms >= start_ms:
            out.append(Change(c.ms - start_ms, c.action, f"node{s}"))
    initial = [Change(0, "add", f"node{s}") for s in range(slots) if _up_at(changes, slots, s, start_ms)]
    return initial + out


def _up_at(changes: list[Change], slots: int, slot: int, ms: int) -> bool:
    """Whether folded node ``slot`` is up just before ``ms`` (a change at ``ms`` itself is the segment's)."""
    up = [False] * slots
    for c in changes:
        if c.ms >= ms:
            break
        s = slot_of(c.node, slots)
        up[s] = c.action == "add"
    return up[slot]


def compress(changes: list[Change], factor: float) -> list[Change]:
    """Every time divided by ``factor`` (> 0), to the millisecond."""
    if not factor > 0:
        raise TraceError(f"--factor: {factor} is not a positive number")
    return [dataclasses.replace(c, ms=round(c.ms / factor)) for c in changes]


def busiest_start(changes: list[Change], slots: int, length_ms: int, lead_ms: int = 180_000,
                  step_ms: int = 60_000) -> int:
    """The start (a multiple of ``step_ms``) of the window of ``length_ms`` whose folded segment holds the most
    changes (a removal counting twice) not in its last ``lead_ms``, none in its first ``lead_ms`` (the run
    starts first), and never every node down (a stalled job measures nothing): the segment the bench plays by
    default. Raises TraceError when there is none."""
    end = max((c.ms for c in changes), default=0)
    best, best_start = 0, None
    for start in range(0, end + 1, step_ms):
        seg = fold(changes, slots, start, start + length_ms)
        initial = sum(1 for s in range(slots) if _up_at(changes, slots, s, start))
        later = seg[initial:]
        if not initial or not later or later[0].ms < lead_ms or not _never_empty(seg):
            continue
        # Changes whose cost the window holds (not those in its last lead_ms), removals first.
        score = sum(2 if c.action == "remove" else 1 for c in later if c.ms <= length_ms - lead_ms)
        if score > best:
            best, best_start = score, start
    if best_start is None:
        raise TraceError(f"no window of {length_ms / 60_000:g} trace minutes with a removal and a node always up "
                         f"folded onto {slots} nodes; give --start-min, or a longer --minutes")
    return best_start


def _never_empty(segment: list[Change]) -> bool:
    """Whether some node is up after every instant's changes (from the first add on)."""
    up: set[str] = set()
    for i, c in enumerate(segment):
        (up.add if c.action == "add" else up.discard)(c.node)
        last_at_instant = i + 1 == len(segment) or segment[i + 1].ms != c.ms
        if last_at_instant and not up:
            return False
    return True


def synthetic_segment() -> str:
    """The test's segment, in the trace's CSV format at trace time (minutes, as the p3 trace): three nodes from
    the start, one reclaimed, back two minutes later, then the node of two workers reclaimed. Compressed by 6
    it runs 100 s."""
    rows = [(0, "add", "node1"), (0, "add", "node2"), (0, "add", "node3"),
            (240_000, "remove", "node3"), (360_000, "add", "node3"), (480_000, "remove", "node2")]
    return "".join(f"{ms},{a},{n}\n" for ms, a, n in rows)


SYNTHETIC_END_MS = 600_000  # trace time: 100 s of wall time compressed by 6


# ------------------------------------------------------------------------------------- the cluster (processes)


def _cluster(endpoint: str, run_id: str, root: Path, nprocs: list[int], every_steps: int) -> Cluster:
    """The chaos cluster (tests/chaos/cluster.py) training the tiny spec for good, saving every ``every_steps``."""
    from tests.chaos.cluster import Cluster

    root.mkdir(parents=True, exist_ok=True)
    # Never ends within a replay; checkpoints every ``every_steps`` (the cadence the model is told).
    return Cluster(endpoint, run_id, root, nprocs, [f"steps={10**6}", f"checkpoint.every_steps={every_steps}",
                                                   "checkpoint.keep_last=3"])


def _first_step_after(events: list[dict], t: float, world: int | None = None):  # type: ignore[no-untyped-def]
    from bench.recovery import first_step_after

    return first_step_after(events, t, world)


def _steps_after_commit(events: list[dict]) -> int:
    """Steps finished after the first committed checkpoint's step."""
    first = next((e["step"] for e in events if e["event"] == "checkpoint_committed"), None)
    return 0 if first is None else sum(e["event"] == "step_done" and e["step"] > first for e in events)


def calibrate(endpoint: str, root: Path, nprocs: list[int], every_steps: int = EVERY_STEPS) -> dict:
    """The costs of this machine, measured on the replay's cluster just before it: a run started, trained past
    its first checkpoint, its last node SIGKILLed, that node started again; seconds by part (see
    :func:`costs_of`). About a minute on an idle 2-core machine; the steps' time on a loaded one."""
    from bench import recovery as rec
    from tests.chaos.cluster import wait_until

    c = _cluster(endpoint, "calibration", root / "calibration", nprocs, every_steps)
    full = sum(nprocs)
    tail = rec.EventTail(c.events_path)
    try:
        for node in c.nodes:
            c.start(node)
        wait_until(lambda: _first_step_after(tail.poll(), 0, full), WAIT_S, "the first step at full world", c)
        # A commit to resume from (its blocking measured), and a step after it (the boundary's end).
        wait_until(lambda: _steps_after_commit(tail.poll()) >= 1, WAIT_S, "a step after a checkpoint", c)
        victim = c.nodes[-1]
        t_kill = time.time()
        c.kill(victim)
        found = wait_until(lambda: _first_step_after(tail.poll(), t_kill), WAIT_S, "training after the kill", c)
        survivor = next(n for n in c.nodes if n is not victim)
        marks = rec.agent_marks(survivor.agent.log.read_text(errors="replace"), time.localtime().tm_year)
        t_join = time.time()
        c.start(victim)
        wait_until(lambda: _first_step_after(tail.poll(), t_join, full), WAIT_S, "the full world again", c)
        # The full world's first steps after the return: its step time.
        wait_until(lambda: (_first_step_after(tail.poll(), t_join, full) or (0, len(tail.events)))[1] + 3
                   <= len(tail.events), WAIT_S, "steps after the return", c)
    finally:
        c.stop_all()
    events = tail.poll()
    return costs_of(events, [t_kill], [t_join], full, every_steps, rec.recovery("kill", t_kill, events, marks))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _process_start(event: dict) -> float:
    return float(event.get("process_start") or event["ts"])


def costs_of(events: list[dict], kills: list[float], joins: list[float], full: int, every_steps: int,
             recovery=None) -> dict:  # type: ignore[no-untyped-def]
    """A run's costs in seconds, each as ``attribute`` would count it, from its events and the wall times its
    nodes were killed (``kills``) and started again (``joins``); medians where there are several:

    - ``step_s``: the step at full world, the mean (``step_s_by_world``: at each world seen);
    - ``commit_s``: training blocked per periodic save (a saved step's end to the next step's start);
    - ``upload_s``: a save's start to its commit (the ``seconds`` of ``checkpoint_committed``);
    - ``first_start_s``: the run's start: the first agent's start -> the resume plan of its first world
      (agents' imports, the first rendezvous, workers' start and load, the run's token store built);
      ``first_restart_s`` its part to the first worker's start, ``first_load_s`` the rest (as ``attribute``);
    - ``load_s``: a restarted worker's start to its resume plan (imports, model, process group, checkpoint);
    - ``kill_restart_s``: a SIGKILL -> the new world's worker start; ``detect_s`` and ``rendezvous_s`` its
      parts from ``recovery`` (bench/recovery.py's, of the survivor's agent log) where given;
    - ``join_boot_s``: a node started -> the survivors' last step (its agent starting and joining: they
      train on meanwhile);
    - ``join_restart_s``: that last step -> the next world's worker start (the survivors' commit and exit,
      the round with the new node, spawn); ``join_commit_s`` the commit on the way out, within it.
    """
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    saved = {e["step"] for e in events if e["event"] == "checkpoint_committed"}
    # A step's wall time as goodput counts it (the previous step's end to its end, the loop's own work between
    # included; not after a save), the mean: a loaded machine's slow steps count, as they do in the run.
    by_world: dict[int, list[float]] = {}
    world, before = 0, None
    for e in events:
        if e["event"] == "start":
            world, before = e["world"], None
        elif e["event"] == "step_done":
            if before is not None and before["step"] not in saved:
                by_world.setdefault(world, []).append(float(e["ts"]) - float(before["ts"]))
            before = e
    blocked, previous = [], None
    for e in events:
        if e["event"] == "start":
            previous = None
        elif e["event"] == "step_done":
            if previous is not None and previous["step"] in saved:
                blocked.append(float(e["ts"]) - float(e["seconds"]) - float(previous["ts"]))
            previous = e
    loads = []
    for i in starts[1:]:  # the first attempt also builds the run's token store: the run's start, not a restart's
        plan = next((e for e in events[i:] if e["event"] == "resume_plan"), None)
        if plan is not None:
            loads.append(float(plan["ts"]) - _process_start(events[i]))
    first = events[starts[0]]
    first_plan = float(next(e for e in events[starts[0]:] if e["event"] == "resume_plan")["ts"])
    kill_restarts = []
    for t in kills:
        i = next((i for i in starts if _process_start(events[i]) > t), None)
        if i is not None:
            kill_restarts.append(_process_start(events[i]) - t)
    boots, commits, join_restarts = [], [], []
    for t in joins:
        i = next((i for i in starts if events[i]["ts"] > t), None)
        if i is None or events[i - 1]["event"] not in ("preempted", "end"):
            continue  # the join's restart was merged with another change: no clean measure of it
        last_step = max((float(e["ts"]) for e in events[:i] if e["event"] == "step_done"), default=t)
        boots.append(last_step - t)
        commits.append(float(events[i - 1]["ts"]) - last_step)
        join_restarts.append(_process_start(events[i]) - last_step)
    uploads = [float(e["seconds"]) for e in events if e["event"] == "checkpoint_committed" and e.get("seconds")]
    kill_restart = _median(kill_restarts)
    detect = recovery.detect if recovery is not None and recovery.detect is not None else 0.0
    return {
        "step_s": statistics.mean(by_world.get(full) or [s for v in by_world.values() for s in v] or [0.0]),
        "step_s_by_world": {str(w): statistics.mean(v) for w, v in sorted(by_world.items())},
        "commit_s": _median(blocked), "upload_s": _median(uploads), "every_steps": every_steps,
        "first_start_s": first_plan - float(first.get("agent_start") or _process_start(first)),
        "first_restart_s": _process_start(first) - float(first.get("agent_start") or _process_start(first)),
        "first_load_s": first_plan - _process_start(first),
        "load_s": _median(loads),
        "kill_restart_s": kill_restart, "detect_s": min(detect, kill_restart),
        "rendezvous_s": kill_restart - min(detect, kill_restart),
        "kill_lost_steps": recovery.lost if recovery is not None else None,
        "join_boot_s": _median(boots), "join_commit_s": _median(commits), "join_restart_s": _median(join_restarts),
        "recovery_parts": dict(recovery.parts) if recovery is not None else None,
    }


def replay(endpoint: str, root: Path, nprocs: list[int], segment: list[Change], end_ms: int,
           every_steps: int = EVERY_STEPS, run_id: str = "replay") -> tuple[float, list[dict]]:
    """Play ``segment`` (folded onto ``len(nprocs)`` nodes node0.., times already compressed) on a new run from
    its 0 ms to ``end_ms``, then until the run trains again (a step ends after ``end_ms``; at most
    ``WAIT_S`` more), and stop every node. Returns (the replay's 0 in wall time, what was done when:
    ``[{t, action, node}]``, t from 0).

    Why not stop at ``end_ms``: a run's goodput ends at its last event, so a run stopped within a restart
    would leave the restart's time out; stopping after a step, the measured wall and the model's end
    (:func:`validate` runs it to the same last event) cover the same time.
    """
    from bench.recovery import EventTail

    c = _cluster(endpoint, run_id, root / run_id, nprocs, every_steps)
    names = {n.name: n for n in c.nodes}
    unknown = sorted({ch.node for ch in segment} - set(names))
    if unknown:
        raise TraceError(f"the segment names {', '.join(unknown)}: fold it onto {len(nprocs)} nodes "
                         f"({', '.join(names)}) first")
    done: list[dict] = []
    tail = EventTail(c.events_path)
    t0 = time.time()
    try:
        for ch in segment:
            time.sleep(max(0.0, t0 + ch.ms / 1000 - time.time()))
            node = names[ch.node]
            if ch.action == "remove":
                c.kill(node)
            elif not node.running:  # fold() never adds a node that is up; a hand-written segment might
                c.start(node)
            done.append({"t": round(time.time() - t0, 3), "action": ch.action, "node": ch.node})
        time.sleep(max(0.0, t0 + end_ms / 1000 - time.time()))
        end = t0 + end_ms / 1000
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not any(e["event"] == "step_done" and e["ts"] >= end
                                                      for e in tail.poll()):
            time.sleep(0.1)  # the run's own progress is the condition; bounded, then stopped as it is
    finally:
        c.stop_all()
    return t0, done


def attempts_of(events: list[dict], t0: float) -> list[dict]:
    """The run's attempts, times from the replay's 0: worker start, resume plan (training begins), world, the
    step resumed from, the last step trained and how the attempt ended (its last event)."""
    out: list[dict] = []
    for e in events:
        if e["event"] == "start":
            out.append({"process_start": round(float(e.get("process_start") or e["ts"]) - t0, 2),
                        "world": e["world"], "trains": None, "resumed": None, "last_step": None})
        elif out:
            a = out[-1]
            if e["event"] == "resume_plan":
                a["trains"], a["resumed"] = round(float(e["ts"]) - t0, 2), e["step"]
            elif e["event"] == "step_done":
                a["last_step"] = e["step"]
            a["ended"], a["end"] = e["event"], round(float(e["ts"]) - t0, 2)
    return out


def measured_goodput(run_dir: Path):  # type: ignore[no-untyped-def]
    """The run's goodput as ``elastic-ft goodput RUN`` gives it (the same loader and attribution), and the wall
    time of its last event (None: no event)."""
    from elastic_ft.runevents.goodput import attribute
    from elastic_ft.runevents.load import load_run_events

    _, events = load_run_events(str(run_dir / "logs" / "events.jsonl"))
    last = max((float(e["ts"]) for e in events if "ts" in e), default=None)
    return attribute(list(events)), last


# ------------------------------------------------------------------------------------------------- the model


def model_costs(measured: dict, nodes: int) -> dict:
    """The goodput model's cost fields (bench/goodput_costs.py) from the calibration's measures, each split as
    ``elastic-ft goodput`` attributes it (restart: up to a worker's start; loading: to its resume plan).

    The model's nodes are alike (``gpus_per_node`` 1: a node is a rank of its batch plan); the cluster's
    differ in workers, so the step measured at full world is spread over the model's micro-batches at
    ``nodes`` ranks. No notices: the replay's removals are kills, so the leave fields are not used.
    """
    from elastic_ft.config import BatchConfig
    from elastic_ft.train.scaling import plan_batch

    batch = BatchConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, policy="constant_global")
    micro_steps = max(plan_batch(batch, 1.0, nodes).micro_steps)
    kill = measured["kill_restart_s"]
    return {
        "gpus_per_node": 1, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
        "every_steps": measured["every_steps"],
        "micro_step_s": measured["step_s"] / micro_steps, "step_sync_s": 0.0,
        "ckpt_block_s": measured["commit_s"], "ckpt_upload_s": measured["upload_s"],
        "commit_sync_s": measured["join_commit_s"],
        "detect_s": min(measured["detect_s"], kill), "rendezvous_s": kill - min(measured["detect_s"], kill),
        "worker_start_s": measured["load_s"], "load_s": 0.0,
        "join_rendezvous_s": max(0.0, measured["join_restart_s"] - measured["join_commit_s"]),
        "join_fetch_s": 0.0, "join_boot_s": measured["join_boot_s"],
        "initial_restart_s": measured["first_restart_s"], "initial_load_s": measured["first_load_s"],
    }


def predict(segment: list[Change], measured: dict, end_ms: int, nodes: int) -> dict:
    """The goodput model (bench/goodput_sim.py's ``simulate``) on the same segment, with the measured costs
    over the ``cpu`` profile, from 0 to ``end_ms``: ``{goodput, categories (seconds), wall_s, recoveries}``."""
    from bench.goodput_costs import CPU, override
    from bench.goodput_sim import simulate
    from bench.goodput_traces import NodeEvent

    fields = model_costs(measured, nodes)
    costs = override(CPU, {k: {"value": v, "source": "bench/trace_replay.py calibration"}
                           for k, v in fields.items()}, "trace_replay")
    trace = [NodeEvent(c.ms / 1000, c.action, c.node) for c in segment]
    r = simulate(trace, costs, min_nodes=1, max_nodes=nodes, end=end_ms / 1000)
    return {"goodput": r.goodput, "categories": dict(r.seconds), "wall_s": r.wall, "costs": fields,
            "recoveries": r.recoveries, "commits": r.commits, "kept_steps": r.kept_steps}


# ------------------------------------------------------------------------------------------------- the report


def compare(measured, predicted: dict) -> dict:  # type: ignore[no-untyped-def]
    """Measured and predicted goodput and categories (fractions of the wall time), and their differences in
    percentage points."""
    from elastic_ft.runevents.goodput import CATEGORIES

    wall = measured.wall or 1.0
    m = {c: measured.seconds[c] / wall for c in CATEGORIES}
    cats = predicted.get("categories", {})
    total = sum(float(v) for v in cats.values()) or 1.0
    # The model may give its categories in seconds or as shares: as shares of its own total either way.
    p = {c: float(cats.get(c, 0.0)) / total for c in CATEGORIES}
    return {
        "measured": {"goodput": measured.goodput, "wall_s": measured.wall, "attempts": measured.attempts, **m},
        "model": {"goodput": float(predicted["goodput"]), **p},
        "points": {"goodput": 100 * (float(predicted["goodput"]) - measured.goodput),
                   **{c: 100 * (p[c] - m[c]) for c in CATEGORIES}},
    }


def table(result: dict) -> str:
    """Measured, predicted (calibrated costs) and hindsight (the replay's own costs) by category, in %."""
    from elastic_ft.runevents.goodput import CATEGORIES, LABELS

    rows = [f"{'':<30}{'measured':>10}{'model':>10}{'model-meas.':>13}{'hindsight':>11}{'hind.-meas.':>13}"]
    for c in ("goodput", *CATEGORIES):
        label = "goodput" if c == "goodput" else LABELS[c]
        m, p = 100 * result["measured"][c], 100 * result["model"][c]
        h = 100 * result["hindsight"][c] if "hindsight" in result else float("nan")
        rows.append(f"{label:<30}{m:>9.1f}%{p:>9.1f}%{p - m:>+12.1f}{h:>10.1f}%{h - m:>+12.1f}")
    return "\n".join(rows)


def fitting_factor(segment: list[Change], measured: dict, most: float) -> float:
    """The compression for ``segment`` (trace times) on a machine whose costs are ``measured``: at most ``most``,
    at least 1, and small enough that the replay measures the segment's changes rather than restarts cut short:
    its first change comes once the run has started and trained (the measured start, 5 steps and 5 s), and
    changes at different times are at least a restart apart (a kill's restart and load, a node's boot, 3 steps).
    On an idle 2-core machine the cap decides; under load the costs do."""
    initial = sum(1 for c in segment if c.ms == 0 and c.action == "add")
    times = sorted({c.ms for c in segment[initial:]})
    if not times:
        return most
    need_start = measured["first_start_s"] + 5 * measured["step_s"] + 5.0
    need_restart = measured["kill_restart_s"] + measured["load_s"] + measured["join_boot_s"] + 3 * measured["step_s"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    fits = [times[0] / 1000 / need_start] + [g / 1000 / need_restart for g in gaps]
    return max(1.0, min(most, *fits))


def validate(endpoint: str, root: Path, segment: list[Change], end_ms: int, nprocs: list[int],
             most_factor: float = 6.0) -> dict:
    """Calibrate, compress ``segment`` (trace times, folded onto ``nprocs``'s nodes, to ``end_ms``) by the
    :func:`fitting_factor`, replay, predict and compare: everything the test asserts on and the bench prints."""
    measured_costs = calibrate(endpoint, root, nprocs)
    factor = fitting_factor(segment, measured_costs, most_factor)
    played, played_end = compress(segment, factor), round(end_ms / factor)
    t0, done = replay(endpoint, root, nprocs, played, played_end)
    measured, last = measured_goodput(root / "replay")
    # The model runs to the run's last event: the wall time ``elastic-ft goodput`` measured.
    model_end_ms = round(1000 * (last - t0)) if last is not None else played_end
    predicted = predict(played, measured_costs, model_end_ms, len(nprocs))
    from elastic_ft.runevents.events import read_events

    events = read_events(str(root / "replay" / "logs" / "events.jsonl"))
    # The diagnosis where they differ: the model again with the costs the replay itself showed (not a
    # prediction): what remains is the model's logic, what goes is the machine's costs moving since calibration.
    kills = [t0 + d["t"] for ch, d in zip(played, done) if ch.action == "remove"]
    joins = [t0 + d["t"] for ch, d in zip(played, done) if ch.action == "add" and ch.ms > 0]
    own = costs_of(events, kills, joins, sum(nprocs), EVERY_STEPS)
    for key in ("detect_s", "rendezvous_s"):  # no agent marks taken in the replay: the calibration's split
        own[key] = own["kill_restart_s"] * (measured_costs[key] / (measured_costs["kill_restart_s"] or 1.0))
    for key in ("join_boot_s", "join_commit_s", "join_restart_s"):  # no clean join in the replay: calibration's
        own[key] = own[key] if joins and own[key] else measured_costs[key]
    if not kills:
        own.update({k: measured_costs[k] for k in ("kill_restart_s", "detect_s", "rendezvous_s")})
    hindsight = predict(played, own, model_end_ms, len(nprocs))
    return {"costs": measured_costs, "factor": factor, "done": done, "attempts": attempts_of(events, t0),
            **compare(measured, predicted), "model_output": predicted, "replay_costs": own,
            "hindsight": compare(measured, hindsight)["model"], "hindsight_output": hindsight,
            "segment": to_csv(played), "end_ms": played_end, "model_end_ms": model_end_ms}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--trace", default=os.environ.get(TRACE_ENV),
                       help=f"a trace CSV 'ms,add|remove,node' (default: ${TRACE_ENV})")
    which.add_argument("--synthetic", action="store_true", help="the test's synthetic segment instead of a trace")
    p.add_argument("--start-min", type=float, default=None,
                   help="the segment's start in the trace, minutes (default: the busiest window)")
    p.add_argument("--minutes", type=float, default=24.0, help="the segment's length in trace minutes (1 to 720)")
    p.add_argument("--factor", type=float, default=6.0,
                   help="the most time compression (trace seconds per wall second); less where the measured start "
                        "needs it (see fitting_factor)")
    p.add_argument("--nprocs", default=",".join(map(str, NPROCS)), help="workers per node (3 or 4 nodes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--keep", action="store_true", help="keep the work directory and print it")
    args = p.parse_args(argv)
    try:
        args.nprocs = [int(n) for n in args.nprocs.split(",")]
    except ValueError:
        p.error(f"--nprocs: {args.nprocs!r} is not a comma-separated list of integers")
    if not 3 <= len(args.nprocs) <= 4 or min(args.nprocs) < 1 or max(args.nprocs) > 4:
        p.error(f"--nprocs: give 3 or 4 nodes of 1 to 4 workers each, not {args.nprocs}")
    if not 1 <= args.minutes <= 720:
        p.error(f"--minutes: {args.minutes} is outside 1 to 720")
    if not 1 <= args.factor <= 600:
        p.error(f"--factor: {args.factor} is outside 1 to 600")
    if not args.synthetic and not args.trace:
        p.error(f"--trace: give a trace's path (or set {TRACE_ENV}), or --synthetic")
    return args


def segment_of(args: argparse.Namespace) -> tuple[list[Change], int, int | None]:
    """(the folded segment in trace time, its end (ms), its start in the trace in ms or None)."""
    slots = len(args.nprocs)
    if args.synthetic:
        return fold(parse_trace(synthetic_segment(), "synthetic"), slots), SYNTHETIC_END_MS, None
    trace = read_trace(args.trace)
    length = round(args.minutes * 60_000)
    # Six trace minutes before the first change: a minute of wall time at 6 (the start takes 25-80 s here).
    start = (busiest_start(trace, slots, length, lead_ms=360_000) if args.start_min is None
             else round(args.start_min * 60_000))
    return fold(trace, slots, start, start + length), length, start


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        segment, end_ms, start = segment_of(args)
    except TraceError as exc:
        print(f"trace_replay: {exc}", file=sys.stderr)
        return 2
    if shutil.which("etcd") is None:
        print("etcd is not installed (scripts/setup.sh --test installs etcd-server)", file=sys.stderr)
        return 2
    from tests.rendezvous.etcd_server import EtcdServer

    root = Path(tempfile.mkdtemp(prefix="bench-trace-replay-"))
    etcd = EtcdServer(root / "etcd").start()
    try:
        result = validate(etcd.endpoint, root, segment, end_ms, args.nprocs, args.factor)
    finally:
        etcd.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result["replay"] = {"source": "synthetic" if args.synthetic else args.trace, "start_ms": start,
                        "minutes": end_ms / 60_000, "factor": result["factor"], "nprocs": args.nprocs}
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(f"segment ({result['replay']}):\n{result['segment']}")
        print(f"costs measured just before: {json.dumps(result['costs'], default=str)}\n")
        print(table(result))
    if args.keep:
        print(f"work directory kept: {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
