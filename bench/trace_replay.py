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
difference. The segment (read, folded onto the cluster's nodes, a window
chosen, compressed by a factor that fits this machine's start and restarts)
is bench/trace_segments.py's; the factor used is printed.

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
import json
import os
import shutil
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

from bench.goodput_traces import NodeEvent, TraceError  # noqa: E402  (after the path set-up above)
from bench.replay_costs import attempts_of, costs_of, model_costs  # noqa: E402
from bench.trace_segments import (  # noqa: E402
    SYNTHETIC_END_MS, Change, busiest_start, compress, fitting_factor, fold, parse_trace, read_trace,
    synthetic_segment, to_csv,
)

TRACE_ENV = "ELASTIC_FT_TRACE"
"""The environment variable naming a trace file (the real p3 trace) for the test and the bench."""
WAIT_S = 240.0  # any single wait of the calibration: far above a healthy recovery on a loaded 2-core machine
NPROCS = (1, 2, 1)
EVERY_STEPS = 5  # a commit to resume from soon after the start, even at a loaded machine's 5 s steps


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


def measured_goodput(run_dir: Path):  # type: ignore[no-untyped-def]
    """The run's goodput as ``elastic-ft goodput RUN`` gives it (the same loader and attribution), and the wall
    time of its last event (None: no event)."""
    from elastic_ft.runevents.goodput import attribute
    from elastic_ft.runevents.load import load_run_events

    _, events = load_run_events(str(run_dir / "logs" / "events.jsonl"))
    last = max((float(e["ts"]) for e in events if "ts" in e), default=None)
    return attribute(list(events)), last


# ------------------------------------------------------------------------------------------------- the model


def predict(segment: list[Change], measured: dict, end_ms: int, nodes: int) -> dict:
    """The goodput model (bench/goodput_sim.py's ``simulate``) on the same segment, with the measured costs
    over the ``cpu`` profile, from 0 to ``end_ms``: ``{goodput, categories (seconds), wall_s, recoveries}``."""
    from bench.goodput_costs import CPU, override
    from bench.goodput_sim import simulate

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
