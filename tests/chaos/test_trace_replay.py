"""The goodput model validated against a measured run: a trace segment replayed on the chaos cluster.

bench/trace_replay.py calibrates this machine's costs on the cluster (one
start, a kill, the node's return), replays a folded, time-compressed segment
of a node availability trace on a new run of the same cluster (a remove is a
SIGKILL of the node's tree, an add starts it again), measures the run's
goodput as ``elastic-ft goodput`` does, and runs bench/goodput_model.py on the
same segment with the calibrated costs. Issue 27: they agree within 5
percentage points, or the model is wrong. Checked first: the model with the
costs the replay itself showed (hindsight) agrees within 5 points, so that a
failure tells the model's logic from the machine's costs moving between the
calibration and the replay (on a 2-core machine shared under a load of 10-30
a worker's start moved from 33 s to 18-31 s between the two).

The synthetic segment (generated in code, the trace's CSV format) runs
everywhere; the real p3 trace's busiest segment runs when ``ELASTIC_FT_TRACE``
names the file (it is data, never copied into the repository).
"""

from __future__ import annotations

import json
import os

import pytest

from bench import trace_replay as tr
from bench import trace_segments as seg

# 3-8 minutes of a quiet machine's time each (a calibration, then the replay), and the prediction holds only
# while the machine's costs hold still between the two: run by scripts/validate_goodput.sh, not in the
# 25-minute suite (as the long chaos run, scripts/chaos.sh).
pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.torchrun, pytest.mark.etcd,
              pytest.mark.skipif("ELASTIC_FT_VALIDATE" not in os.environ,
                                 reason="the goodput model's validation run: scripts/validate_goodput.sh")]
pytest.importorskip("bench.goodput_sim", reason="the goodput model (bench/goodput_sim.py) is not in this tree")

TOLERANCE_POINTS = 5.0
NPROCS = [1, 2, 1]


def check(result: dict, segment: list[seg.Change], out) -> None:  # type: ignore[no-untyped-def]
    out.write_text(json.dumps(result, default=str, indent=1))  # for the figures, and for a failure's why
    assert len(result["done"]) == len(segment), result["done"]  # every change of the segment was played
    # The run trained after the segment's end, so its goodput covers every change's cost.
    assert result["attempts"] and result["attempts"][-1]["end"] * 1000 >= result["end_ms"], result["attempts"]
    why = (f"\n{tr.table(result)}\nfactor {result['factor']:.2f}; calibrated costs: {result['costs']}\n"
           f"the replay's own: {result['replay_costs']}\nattempts: {result['attempts']}\n"
           f"model: {result['model_output']}")
    # The model's logic: with the costs the replay itself showed it gives the goodput measured.
    hindsight = 100 * (result["hindsight"]["goodput"] - result["measured"]["goodput"])
    assert abs(hindsight) <= TOLERANCE_POINTS, f"with the replay's own costs the model differs by {hindsight:+.1f}{why}"
    # The prediction (issue 27): with the costs measured just before.
    assert abs(result["points"]["goodput"]) <= TOLERANCE_POINTS, (
        f"model and measurement differ by {result['points']['goodput']:+.1f} points (the costs moved since the "
        f"calibration where the hindsight column agrees){why}")


def test_synthetic_segment_goodput_agrees_with_the_model(etcd, tmp_path):
    segment = seg.fold(seg.parse_trace(seg.synthetic_segment(), "synthetic"), len(NPROCS))
    check(tr.validate(etcd.endpoint, tmp_path, segment, seg.SYNTHETIC_END_MS, NPROCS), segment,
          tmp_path / "result.json")


def test_p3_trace_segment_goodput_agrees_with_the_model(etcd, tmp_path):
    path = os.environ.get(tr.TRACE_ENV)
    if not path:
        pytest.skip(f"{tr.TRACE_ENV} is not set: name the p3 Spot trace (../shared/traces/p3-spot-32.csv) to run it")
    if not os.path.isfile(path):
        pytest.skip(f"{tr.TRACE_ENV}={path}: no such file")
    args = tr.parse(["--trace", path, "--nprocs", ",".join(map(str, NPROCS))])
    segment, end_ms, _ = tr.segment_of(args)
    check(tr.validate(etcd.endpoint, tmp_path, segment, end_ms, NPROCS), segment, tmp_path / "result.json")
