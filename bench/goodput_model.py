"""Goodput of a run on a Spot fleet, modelled: a real availability trace or synthetic ones at the Spot
Advisor's interruption buckets, with this machine's measured costs or an 8B-LoRA GPU profile.

The model (bench/goodput_sim.py) is driven by the product's own decisions
(batch plan, checkpoint cadence, spot response, resume plan); the costs
(bench/goodput_costs.py) each carry their source. Printed: wall time by the
categories of ``elastic-ft goodput``, tokens trained, the cost per million
tokens against the same job on on-demand nodes, and checkpoint intervals
(fixed ``every_steps`` against Young/Daly's sqrt(2 C MTBF)).

    python bench/goodput_model.py --trace ../shared/traces/p3-spot-32.csv [--notice-s 120] [--profile gpu]
    python bench/goodput_model.py [--nodes 8,64,512] [--hours 168] [--seed 0] [--plot goodput.png]
    common: [--costs FILE.json] [--every-steps N] [--min-nodes N] [--max-nodes N]
            [--spot-price P] [--on-demand-price P] [--json]

Without ``--trace`` it runs the synthetic matrix: every bucket x ``--nodes``,
without notices and with ``--notice-s`` (120 s if 0), each node replaced
``--replace-s`` after its reclaim. A trace file is read, never copied.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import goodput_costs, goodput_traces  # noqa: E402  (after the path set-up above)
from bench.goodput_sim import Result, Run, simulate  # noqa: E402
from bench.goodput_traces import BUCKETS, NodeEvent  # noqa: E402
from elastic_ft.runevents.goodput import CATEGORIES, LABELS  # noqa: E402
from elastic_ft.train.checkpoint_interval import choose_interval  # noqa: E402

INTERVALS = (5, 10, 20, 50, 100, 200, 500)


def on_demand(costs: goodput_costs.Costs, nodes: int, hours: float, **kw) -> Result:
    """The same job on ``nodes`` on-demand nodes for as long: no node ever goes."""
    trace = [NodeEvent(0.0, "add", f"od{i}") for i in range(nodes)]
    return simulate(trace, costs, max_nodes=nodes, end=hours * 3600.0, **kw)


def per_mtok(result: Result, price: float, node_seconds: float | None = None) -> float:
    """Dollars per million kept tokens at ``price`` per node-hour."""
    seconds = result.node_seconds if node_seconds is None else node_seconds
    return seconds / 3600.0 * price / (result.tokens / 1e6) if result.tokens > 0 else float("inf")


def summary(result: Result, od: Result, args: argparse.Namespace) -> dict:
    return {
        "goodput": round(result.goodput, 5), "categories": {c: round(result.seconds[c], 2) for c in CATEGORIES},
        "wall_s": round(result.wall, 1), "kept_steps": result.kept_steps, "tokens": result.tokens,
        "commits": result.commits, "every_steps": result.every_steps,
        "losses": sum(1 for r in result.recoveries if r["kind"] == "rollback"),
        "redone_steps": sum(r.get("redone_steps", 0) for r in result.recoveries),
        "leaves": sum(1 for r in result.recoveries if r["kind"] == "leave"),
        "joins": sum(1 for r in result.recoveries if r["kind"] == "join"),
        "cost_per_mtok": {"spot": round(per_mtok(result, args.spot_price), 6),
                          "on_demand": round(per_mtok(od, args.on_demand_price), 6)},
        "on_demand_goodput": round(od.goodput, 5),
    }


def losses(trace: list[NodeEvent], end: float) -> int:
    """Removals that cost redone steps (those without a notice) up to ``end``."""
    return sum(1 for e in trace if e.kind == "remove" and e.notice_s == 0 and e.t <= end)


def intervals(trace: list[NodeEvent], costs, end: float, kw: dict) -> list[dict]:
    """Goodput at fixed every_steps and at the interval ``checkpoint.every_steps: auto`` chooses (the product's
    :func:`choose_interval`: Young/Daly from the blocking per save and the trace's losses over its length)."""
    probe = Run(trace, costs, min_nodes=kw["min_nodes"], max_nodes=kw["max_nodes"], end=end)
    step_s = probe.step_s(kw["max_nodes"])
    yd = choose_interval(commit_s=costs.ckpt_block_s, step_s=step_s, losses=losses(trace, end), exposure_s=end,
                         prior_mtbf_s=end).steps
    rows = []
    for every in sorted(set(INTERVALS) | {costs.every_steps, yd}):
        r = simulate(trace, costs, end=end, every_steps=every, **kw)
        rows.append({"every_steps": every, "goodput": round(r.goodput, 5),
                     "young_daly": every == yd, "profile_default": every == costs.every_steps})
    return rows


def run_trace(args: argparse.Namespace, costs) -> dict:
    trace = goodput_traces.read_csv(args.trace, args.notice_s)
    end = goodput_traces.duration(trace)
    kw = {"min_nodes": args.min_nodes, "max_nodes": args.max_nodes or goodput_traces.peak(trace)}
    result = simulate(trace, costs, end=end, every_steps=args.every_steps, **kw)
    od = on_demand(costs, kw["max_nodes"], end / 3600.0, min_nodes=args.min_nodes, every_steps=args.every_steps)
    out = {"trace": args.trace, "profile": costs.name, "notice_s": args.notice_s, "nodes": kw["max_nodes"],
           "removals": sum(1 for e in trace if e.kind == "remove"), "hours": round(end / 3600.0, 2),
           **summary(result, od, args)}
    out["intervals"] = intervals(trace, costs, end, kw)
    return out


def run_matrix(args: argparse.Namespace, costs) -> dict:
    runs = []
    for nodes in args.nodes:
        od = on_demand(costs, nodes, args.hours, min_nodes=args.min_nodes, every_steps=args.every_steps)
        for bucket, share in BUCKETS.items():
            for notice in (0.0, args.notice_s or 120.0):
                trace = goodput_traces.synthetic(nodes=nodes, monthly_share=share, hours=args.hours,
                                                 seed=args.seed, replace_s=args.replace_s, notice_s=notice)
                r = simulate(trace, costs, min_nodes=args.min_nodes, max_nodes=nodes, end=args.hours * 3600.0,
                             every_steps=args.every_steps)
                runs.append({"bucket": bucket, "monthly_share": share, "nodes": nodes, "notice_s": notice,
                             "removals": sum(1 for e in trace if e.kind == "remove"), **summary(r, od, args)})
    key = "{bucket}/{nodes}/{notice_s:g}".format
    return {"profile": costs.name, "hours": args.hours, "seed": args.seed, "replace_s": args.replace_s,
            "goodput": {key(**r): r["goodput"] for r in runs}, "categories": {key(**r): r["categories"] for r in runs},
            "runs": runs}


# ---------------------------------------------------------------------------------------------- report


def category_table(out: dict) -> str:
    wall = out["wall_s"]
    rows = [f"{'category (elastic-ft goodput)':<32}{'seconds':>12}{'%':>8}"]
    rows += [f"{LABELS[c]:<32}{out['categories'][c]:>12.1f}{100 * out['categories'][c] / wall:>8.2f}"
             for c in CATEGORIES]
    rows.append(f"{'wall':<32}{wall:>12.1f}{100.0:>8.2f}")
    return "\n".join(rows)


def trace_report(out: dict, costs, args: argparse.Namespace) -> str:
    cost = out["cost_per_mtok"]
    lines = [f"goodput model: trace {out['trace']} ({out['nodes']} nodes at most, {out['removals']} removals, "
             f"{out['hours']} h), profile {costs.name}, notice {out['notice_s']:g} s, every_steps "
             f"{out['every_steps']}", "", category_table(out), "",
             f"goodput {100 * out['goodput']:.2f} %  ({out['losses']} unannounced losses redoing "
             f"{out['redone_steps']} steps, {out['leaves']} leaves on a notice, {out['joins']} joins; "
             f"{out['commits']} commits)",
             f"tokens kept {out['tokens']:.4g}; $ per million tokens: spot {cost['spot']:.4g} at "
             f"{args.spot_price:g}/node-h, on-demand {cost['on_demand']:.4g} at {args.on_demand_price:g}/node-h "
             f"({out['nodes']} nodes, goodput {100 * out['on_demand_goodput']:.2f} %)", "",
             "checkpoint interval: goodput on this trace"]
    for r in out["intervals"]:
        tag = " <- Young/Daly sqrt(2 C MTBF)" if r["young_daly"] else ""
        tag += " <- profile default" if r["profile_default"] else ""
        lines.append(f"  every_steps {r['every_steps']:>5}: {100 * r['goodput']:6.2f} %{tag}")
    return "\n".join(lines)


def matrix_report(out: dict, costs) -> str:
    runs = out["runs"]
    notices = sorted({r["notice_s"] for r in runs})
    nodes = sorted({r["nodes"] for r in runs})
    head = "".join(f"{f'{n} nodes' + (f' {s:g}s' if s else ' none'):>17}" for n in nodes for s in notices)
    lines = [f"goodput model: synthetic traces, profile {costs.name}, {out['hours']:g} h, seed {out['seed']}, "
             f"replacement after {out['replace_s']:g} s; columns: nodes and notice", f"{'bucket':<10}{head}"]
    for bucket in BUCKETS:
        cells = [next(r for r in runs if r["bucket"] == bucket and r["nodes"] == n and r["notice_s"] == s)
                 for n in nodes for s in notices]
        lines.append(f"{bucket:<10}" + "".join(f"{100 * c['goodput']:>15.2f} %" for c in cells))
    return "\n".join(lines)


def cost_table(costs) -> str:
    rows = [f"cost table '{costs.name}':"]
    for name, source in costs.sources.items():
        rows.append(f"  {name} = {getattr(costs, name)}: {source}")
    return "\n".join(rows)


def plot(out: dict, path: str) -> None:
    """Goodput against nodes, one line per interruption bucket, a panel per notice setting (Agg, no display)."""
    from elastic_ft.viz.figure import _matplotlib

    Figure, FigureCanvasAgg, _ = _matplotlib()
    runs = out["runs"]
    notices = sorted({r["notice_s"] for r in runs})
    fig = Figure(figsize=(6 * len(notices), 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    for ax, notice in zip(fig.subplots(1, len(notices), squeeze=False)[0], notices):
        for bucket in BUCKETS:
            pts = sorted((r["nodes"], 100 * r["goodput"]) for r in runs
                         if r["bucket"] == bucket and r["notice_s"] == notice)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{bucket} a month")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_ylabel("goodput (%)")
        ax.set_title(f"{out['profile']} profile, " + (f"{notice:g} s notice" if notice else "no notice"))
        ax.grid(True, alpha=0.3)
        ax.legend(title="Spot interruptions")
    fig.savefig(path)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", help="CSV of ms,add|remove,node (read in place); default: the synthetic matrix")
    p.add_argument("--notice-s", type=float, default=0.0, help="every removal's notice (s); 0: unannounced")
    p.add_argument("--profile", choices=sorted(goodput_costs.PROFILES), default="cpu")
    p.add_argument("--costs", help="JSON file overriding cost fields (see bench/goodput_costs.py)")
    p.add_argument("--every-steps", type=int, help="checkpoint.every_steps (default: the profile's)")
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--max-nodes", type=int, help="default: the trace's peak (synthetic: --nodes)")
    p.add_argument("--nodes", default="8,64,512", help="synthetic fleet sizes, comma-separated")
    p.add_argument("--hours", type=float, default=168.0, help="synthetic trace length")
    p.add_argument("--replace-s", type=float, default=300.0, help="synthetic: a reclaimed node's replacement delay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spot-price", type=float, default=0.3, help="per node-hour (default: 30 %% of on-demand)")
    p.add_argument("--on-demand-price", type=float, default=1.0, help="per node-hour")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", help="PNG of goodput against nodes and interruption rate (synthetic matrix)")
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        args.nodes = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        p.error(f"--nodes: {args.nodes!r} is not a comma-separated list of whole numbers")
    bounds = {"--notice-s": (args.notice_s, 0, 3600), "--hours": (args.hours, 0.01, 24 * 366),
              "--replace-s": (args.replace_s, 0, 86400), "--min-nodes": (args.min_nodes, 1, 100_000),
              "--spot-price": (args.spot_price, 0, 1e6), "--on-demand-price": (args.on_demand_price, 0, 1e6),
              "--every-steps": (args.every_steps or 1, 1, 10**9), "--max-nodes": (args.max_nodes or 1, 1, 100_000)}
    bounds.update({"--nodes": (n, 1, 100_000) for n in args.nodes})
    for flag, (value, lo, hi) in bounds.items():
        if not lo <= value <= hi:
            p.error(f"{flag}: {value} is out of range; give {lo} to {hi}")
    if args.max_nodes and args.min_nodes > args.max_nodes:
        p.error(f"--min-nodes ({args.min_nodes}) is above --max-nodes ({args.max_nodes}): the run could never start")
    if args.plot and args.trace:
        p.error("--plot draws the synthetic matrix (goodput against nodes and rate): drop --trace")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        costs = goodput_costs.load(args.profile, args.costs)
        out = run_trace(args, costs) if args.trace else run_matrix(args, costs)
    except (goodput_costs.CostsError, goodput_traces.TraceError) as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.plot:
        plot(out, args.plot)
    if args.json:
        out["costs"] = {k: {"value": getattr(costs, k), "source": v} for k, v in costs.sources.items()}
        print(json.dumps(out, indent=1))
    else:
        print(trace_report(out, costs, args) if args.trace else matrix_report(out, costs))
        print()
        print(cost_table(costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
