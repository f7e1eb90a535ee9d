"""Spot preemption on the real stack: recovery time in parts, steps lost, and goodput with preemptions.

One run of heterogeneous torchrun agents (default nproc 1 and 2) on etcd3,
training the tiny spec (specs/tiny-lora.yaml) with file:// checkpoints, each
node with its own local IMDS (tests/spot/imds_server.py), everything on
127.0.0.1 (the chaos cluster of tests/chaos/cluster.py). The rendezvous and
spot settings are the product's defaults (keep-alive 2 s x 3, last call 3 s,
IMDS polled every second) unless --rdzv-conf says otherwise.

Every ``--interval`` seconds (first at half of it) one node is preempted, in
the order of ``--events``:

- notice: its IMDS serves a ``terminate`` instance-action (two minutes ahead);
- sigterm: SIGTERM to its agent (a container stop);
- kill: its agent's process tree SIGKILLed (a lost machine);
- silent: its tree SIGSTOPped (no exit, no TCP reset), SIGKILLed once the
  others train again.

Once the others train again the node is started again (a replacement
instance) and the bench waits for the full world to train, then for the next
event. After the last interval the run is stopped, and the same cluster trains
a run without preemptions for as many steps. Printed:

1. per event, from the event to the first step of the new world, in parts
   taken from the events' and the agent log's timestamps (see
   bench/recovery.py), the steps lost, and the node's return;
2. goodput by category (elastic_ft.runevents.goodput.attribute) of both runs, the cost
   per preemption measured from them and the goodput projected to one
   preemption every 5 minutes (formula printed);
3. the issue's targets, met or not.

    python bench/preemption.py [--events notice,kill,silent] [--interval 60] [--nprocs 1,2]
                               [--rdzv-conf CONF] [--every-steps N] [--starts warm,cold] [--keep]

All of it runs once per ``--starts`` mode: workers forked warm by the node's
warm process (elastic_ft.warm, the default), then cold (ELASTIC_FT_WARM_START=0:
every worker imports everything itself, the code path before warm starts), so
the two columns are measured on the same machine in the same run. Each mode
takes about 6-8 minutes on 2 cores; ``--events
notice,kill,silent,sigterm,notice,kill`` runs longer.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from bench import recovery as rec  # noqa: E402
from elastic_ft.runevents.events import read_events  # noqa: E402
from elastic_ft.runevents.goodput import CATEGORIES, LABELS, Goodput, attribute  # noqa: E402
from elastic_ft.warm.protocol import SWITCH_ENV  # noqa: E402
from tests.chaos.cluster import Cluster, Node, wait_until  # noqa: E402
from tests.rendezvous.etcd_server import EtcdServer  # noqa: E402

KINDS = rec.ANNOUNCED + rec.UNANNOUNCED
WAIT_S = 240.0  # any single wait: far above a healthy recovery on a loaded 2-core machine
PROJECT_EVERY_S = 300.0
TARGETS = {"notice_s": 15.0, "silent_detect_s": 15.0, "goodput": 0.90}


class BenchCluster(Cluster):
    """The chaos cluster (each node with its own IMDS) with the rendezvous options given (default: none)."""

    def __init__(self, endpoint: str, run_id: str, root: Path, nprocs: list[int], overrides: list[str],
                 rdzv_conf: str) -> None:
        super().__init__(endpoint, run_id, root, nprocs, overrides)
        self.rdzv_conf = rdzv_conf

    def command(self, node: Node) -> list[str]:
        cmd = super().command(node)
        i = cmd.index("--rdzv-conf")
        # The chaos tests tune the heartbeat; the bench measures what a user gets.
        return cmd[:i] + (["--rdzv-conf", self.rdzv_conf] if self.rdzv_conf else []) + cmd[i + 2:]


def trigger(c: BenchCluster, node: Node, kind: str) -> float:
    """Preempt ``node`` by ``kind``; the wall time just before it was done."""
    t0 = time.time()
    if kind == "notice":
        c.serve_notice(node)
    elif kind == "sigterm":
        node.agent.process.send_signal(signal.SIGTERM)
    elif kind == "kill":
        c.kill(node)
    else:
        c.silence(node)
    return t0


def leader_log(c: BenchCluster, events: list[dict], i_start: int, victim: Node) -> Path:
    """The log of the node whose agent started the new world's leader (the ``start`` event names it);
    where that cannot be told, the log of a node still running other than ``victim``."""
    agent_pid = events[i_start].get("agent_pid")
    running = [n for n in c.nodes if n is not victim and n.running]
    return next((n.agent.log for n in running if n.agent.pid == agent_pid), running[0].agent.log)


def wait_recovered(c: BenchCluster, tail: rec.EventTail, node: Node, t0: float) -> tuple[tuple[int, int], dict]:
    """Wait for the first step of the new world; what was seen of the preempted node's agent on the way."""
    seen: dict = {}

    def recovered():  # type: ignore[no-untyped-def]
        if "exit" not in seen and node.agent.poll() is not None:
            seen["exit"], seen["code"] = time.time() - t0, node.agent.poll()
        return rec.first_step_after(tail.poll(), t0)

    found = wait_until(recovered, WAIT_S, f"the first step after the event at {t0:.1f}", c, poll=0.05)
    return found, seen


def preempt_once(c: BenchCluster, tail: rec.EventTail, node: Node, kind: str, full: int) -> dict:
    """One event and the node's return; what the report needs of it."""
    t0 = trigger(c, node, kind)
    found, seen = wait_recovered(c, tail, node, t0)
    log = leader_log(c, tail.events, found[0], node)
    if kind == "silent":
        c.kill(node)  # the stopped machine is gone for good
    elif kind in rec.ANNOUNCED and "exit" not in seen:
        try:
            seen["code"] = node.agent.wait(60)
            seen["exit"] = time.time() - t0
        except AssertionError:
            c.kill(node)
            seen["code"] = "killed after 60 s"
    t_join = time.time()
    c.start(node)  # a replacement instance: its IMDS serves no notice
    wait_until(lambda: rec.first_step_after(tail.poll(), t_join, full), WAIT_S, "the full world again", c,
               poll=0.1)
    return {"kind": kind, "t0": t0, "log": log, "t_join": t_join, **seen}


def run_with_preemptions(args: argparse.Namespace, etcd: EtcdServer, root: Path) -> tuple[list[dict], list[dict]]:
    """The run with ``args.events``: its events (to the stop) and what each preemption recorded."""
    c = BenchCluster(etcd.endpoint, "preempted", root / "preempted", args.nprocs, overrides(args, 10**6),
                     args.rdzv_conf)
    c.root.mkdir(parents=True)
    tail, full = rec.EventTail(c.events_path), sum(args.nprocs)
    done: list[dict] = []
    try:
        for node in c.nodes:
            c.start(node)
        i_start, i_step = wait_until(lambda: rec.first_step_after(tail.poll(), 0, full), WAIT_S,
                                     "the first step at full world", c)
        t_first = tail.events[i_step]["ts"]
        for k, kind in enumerate(args.events):
            time.sleep(max(0.0, t_first + (k + 0.5) * args.interval - time.time()))
            node = c.nodes[k % len(c.nodes)]
            print(f"  {time.time() - t_first:6.1f} s: {kind} of {node.name} (nproc {node.nproc})", flush=True)
            done.append(preempt_once(c, tail, node, kind, full))
        time.sleep(max(0.0, t_first + len(args.events) * args.interval - time.time()))
    finally:
        c.stop_all()
    return read_events(str(c.events_path)), done


def run_without(args: argparse.Namespace, etcd: EtcdServer, root: Path, steps: int) -> list[dict]:
    """The same cluster trained for ``steps`` steps, nothing preempted, to its end: its events."""
    c = BenchCluster(etcd.endpoint, "baseline", root / "baseline", args.nprocs, overrides(args, steps),
                     args.rdzv_conf)
    c.root.mkdir(parents=True)
    tail = rec.EventTail(c.events_path)
    try:
        for node in c.nodes:
            c.start(node)
        wait_until(lambda: tail.poll() and tail.events[-1]["event"] == "end", 4 * WAIT_S,
                   f"the end of the run without preemptions ({steps} steps)", c, poll=1)
        for node in c.nodes:
            node.agent.wait(60)
    finally:
        c.stop_all()
    return read_events(str(c.events_path))


def overrides(args: argparse.Namespace, steps: int) -> list[str]:
    out = [f"steps={steps}"]
    if args.every_steps is not None:
        out.append(f"checkpoint.every_steps={args.every_steps}")
    return out


# ---------------------------------------------------------------------------------------------- report


def _s(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def recovery_table(recoveries: list[rec.Recovery], done: list[dict], joins: list[rec.Join | None]) -> str:
    names: list[str] = []
    for r in recoveries:
        names += [p for p, _ in r.parts if p not in names]
    head = ["seconds, from the event"] + [f"{d['kind']} #{i + 1}" for i, d in enumerate(done)]
    rows = [head]
    for name in names:
        rows.append([f"  {name}"] + [_s(dict(r.parts)[name]) if name in dict(r.parts) else "-" for r in recoveries])
    rows.append(["event -> first step of the new world"] + [_s(r.total) for r in recoveries])
    rows.append(["world before -> after"] + [f"{a} -> {b}" for a, b in (r.worlds for r in recoveries)])
    rows.append(["steps lost (trained again)"] + [str(r.lost) for r in recoveries])
    rows.append(["steps since the last commit"] + [str(r.since_commit) for r in recoveries])
    rows.append(["preempted agent exited (s, status)"] +
                [f"{d['exit']:.2f}, {d['code']}" if "exit" in d else str(d.get("code", "-")) for d in done])
    rows.append(["node back: training paused (s)"] + [_s(j.pause if j else None) for j in joins])
    rows.append(["node back: steps lost"] + [str(j.lost) if j else "?" for j in joins])
    return rec.table(rows, "<" + ">" * len(done))


def goodput_table(with_: Goodput, without: Goodput) -> str:
    def cell(g: Goodput, c: str) -> str:
        return f"{g.seconds[c]:.1f} ({100 * g.seconds[c] / g.wall:.1f} %)" if g.wall > 0 else "-"

    rows = [["goodput (elastic_ft.runevents.goodput)", "with preemptions", "without"]]
    rows += [[LABELS[c], cell(with_, c), cell(without, c)] for c in CATEGORIES]
    rows.append(["wall (s)", f"{with_.wall:.1f}", f"{without.wall:.1f}"])
    rows.append(["attempts", str(with_.attempts), str(without.attempts)])
    rows.append(["goodput", f"{100 * with_.goodput:.1f} %", f"{100 * without.goodput:.1f} %"])
    return rec.table(rows, "<>>")


def targets_table(recoveries: list[rec.Recovery], projected: float) -> str:
    announced = [r for r in recoveries if r.kind in rec.ANNOUNCED]
    unannounced = [r for r in recoveries if r.kind in rec.UNANNOUNCED]
    notices = [r.total for r in recoveries if r.kind == "notice"]
    silent = [r.detect for r in recoveries if r.kind == "silent"]
    rows = [["target", "measured", "met"]]

    def add(name: str, shown: str, met: bool | None) -> None:
        rows.append([name, shown, "-" if met is None else ("yes" if met else "NO")])

    lost_a = [r.lost for r in announced]
    add("steps lost per announced preemption = 0", ", ".join(map(str, lost_a)) or "-",
        all(x == 0 for x in lost_a) if lost_a else None)
    add("steps lost per unannounced <= steps since last commit",
        ", ".join(f"{r.lost} <= {r.since_commit}" for r in unannounced) or "-",
        all(r.lost <= r.since_commit for r in unannounced) if unannounced else None)
    add(f"notice -> first step of new world < {TARGETS['notice_s']:.0f} s", ", ".join(_s(x) for x in notices) or "-",
        all(x < TARGETS["notice_s"] for x in notices) if notices else None)
    add(f"silent node detected < {TARGETS['silent_detect_s']:.0f} s", ", ".join(_s(x) for x in silent) or "-",
        all(x is not None and x < TARGETS["silent_detect_s"] for x in silent) if silent else None)
    add(f"goodput projected to one preemption / 5 min >= {100 * TARGETS['goodput']:.0f} %",
        f"{100 * projected:.1f} %", projected >= TARGETS["goodput"])
    return rec.table(rows, "<><")


def report(args: argparse.Namespace, events: list[dict], done: list[dict], base_events: list[dict]) -> str:
    year = datetime.datetime.now().year
    full = sum(args.nprocs)
    recoveries = [rec.recovery(d["kind"], d["t0"], events, rec.agent_marks(Path(d["log"]).read_text(errors="replace"),
                                                                           year)) for d in done]
    joins = [rec.join(events, d["t_join"], full) for d in done]
    with_, without = attribute(events), attribute(base_events)
    proj = rec.project(with_, without, len(done))
    lines = [
        f"Preemption bench: nodes nproc {','.join(map(str, args.nprocs))} (world {full}) on etcd3, tiny spec, "
        f"file:// checkpoints; rdzv-conf {args.rdzv_conf or '(defaults: keep-alive 2 s x 3, last call 3 s)'}; "
        f"spot poll 1 s",
        "",
        recovery_table(recoveries, done, joins),
        "",
        goodput_table(with_, without),
        "",
        f"preemptions: {len(done)} in {with_.wall:.0f} s (one per {with_.wall / max(1, len(done)):.0f} s), "
        f"each followed by the node's return",
        f"cost per preemption c = (W - K - S0 - r0*K) / n = {proj.cost_s:.1f} s   (W, K: wall and kept s with "
        f"preemptions; S0 = {without.seconds['restart'] + without.seconds['loading']:.1f} s: the one-time start "
        f"without; r0 = {proj.checkpoint_ratio:.4f}: checkpoint s per kept s without)",
        f"projected goodput, one preemption every T s: G(T) = (1 - c/T) / (1 + r0):  "
        f"G(60) = {100 * proj.goodput(60):.1f} %,  G(300) = {100 * proj.goodput(PROJECT_EVERY_S):.1f} %",
        "",
        targets_table(recoveries, proj.goodput(PROJECT_EVERY_S)),
    ]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", default="notice,kill,silent",
                   help=f"comma-separated preemptions in order, of {', '.join(KINDS)}")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between preemptions")
    p.add_argument("--nprocs", default="1,2", help="workers per node, comma-separated (2 or 3 nodes)")
    p.add_argument("--rdzv-conf", default="", help="torchrun --rdzv-conf (default: none, the product's defaults)")
    p.add_argument("--every-steps", type=int, default=None, help="checkpoint.every_steps (default: the spec's)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, events) and print it")
    p.add_argument("--starts", default="warm,cold",
                   help="worker starts to measure, in turn: warm (forked by the node's warm process, the "
                        "default), cold (each worker imports everything itself, as before; "
                        f"{SWITCH_ENV}=0)")
    args = p.parse_args(argv)
    args.starts = [s.strip() for s in args.starts.split(",") if s.strip()]
    if not args.starts or set(args.starts) - {"warm", "cold"}:
        p.error(f"--starts: {args.starts}: give warm, cold or both")
    args.events = [e.strip() for e in args.events.split(",") if e.strip()]
    bad = [e for e in args.events if e not in KINDS]
    if bad or not args.events:
        p.error(f"--events: {bad or 'none given'}: each must be one of {', '.join(KINDS)}")
    try:
        args.nprocs = [int(n) for n in args.nprocs.split(",")]
    except ValueError:
        p.error(f"--nprocs: {args.nprocs!r} is not a comma-separated list of integers")
    if not 2 <= len(args.nprocs) <= 3 or min(args.nprocs) < 1:
        p.error(f"--nprocs: give 2 or 3 nodes of at least 1 worker each, not {args.nprocs}")
    if args.interval < 20:
        p.error(f"--interval: {args.interval} s is shorter than a recovery and a return; give 20 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if shutil.which("etcd") is None:
        print("etcd is not installed (scripts/setup.sh --test installs etcd-server)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="bench-preemption-"))
    etcd = EtcdServer(root / "etcd").start()
    try:
        reports = []
        for start in args.starts:
            # Every agent started from here on inherits it (tests/rendezvous/agents.py copies os.environ).
            os.environ[SWITCH_ENV] = "1" if start == "warm" else "0"
            print(f"[{start} worker starts] run with preemptions: {', '.join(args.events)}, "
                  f"every {args.interval:.0f} s", flush=True)
            events, done = run_with_preemptions(args, etcd, root / start)
            steps = max((e["step"] for e in events if e["event"] == "step_done"), default=0)
            print(f"[{start} worker starts] run without preemptions: {steps} steps", flush=True)
            base = run_without(args, etcd, root / start, steps)
            reports.append(f"=== {start} worker starts ({SWITCH_ENV}={os.environ[SWITCH_ENV]})\n"
                           + report(args, events, done, base))
        print()
        print("\n\n".join(reports))
    finally:
        etcd.stop()
        if args.keep:
            print(f"\nwork directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
