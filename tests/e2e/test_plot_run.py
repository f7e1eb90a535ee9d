"""``elastic-ft plot`` and ``logging.tensorboard`` on a real run: two ranks under torchrun, killed after step 5
and resumed (the ``resumed_run`` fixture, shared with the goodput test)."""

from __future__ import annotations

import os

import pytest

from elastic_ft.runevents.events import read_events
from elastic_ft.viz.figure import draw
from elastic_ft.viz.series import run_series
from tests.conftest import cli, explain, png_size

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # the fixture's two torchrun attempts (~25 s, once per session)


def kept_steps(events: list[dict]) -> dict[int, dict]:
    """Step -> the step event of its last try (the resume is from a checkpoint, so the last try is kept)."""
    return {e["step"]: e for e in events if e["event"] == "step"}


def test_plot_of_a_killed_and_resumed_run(resumed_run, tmp_path):
    out = str(tmp_path / "run.png")
    proc = cli("plot", f"file://{os.path.dirname(resumed_run)}/run", "--out", out, "--width", "1000", "--height", "640")
    assert proc.returncode == 0, explain(proc)
    assert png_size(out) == (1000, 640)
    assert "6 steps, 2 attempt(s)" in proc.stdout and "1 restart" in proc.stdout

    events = read_events(os.path.join(resumed_run, "logs", "events.jsonl"))
    series = run_series(events)
    kept = kept_steps(events)
    assert series.step == [1, 2, 3, 4, 5, 6] and series.attempts == 2
    assert series.loss == [kept[n]["loss"] for n in series.step]
    resumed = [e["step"] for e in events if e["event"] == "resume_plan"][-1]
    assert resumed > 0 and {kept[n]["attempt"] for n in series.step} == {1, 2}
    assert all(kept[n]["attempt"] == (1 if n <= resumed else 2) for n in series.step)
    # Tries of attempt 1 past the resume point are apart (reported in batches of 3, the kill may cut them off).
    lost = sorted(e["step"] for e in events if e["event"] == "step" and e["attempt"] == 1 and e["step"] > resumed)
    assert series.redone_step == lost
    assert [seg.attempt for seg in series.segments] == [1, 2]
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    assert [m.step for m in series.marks if m.kind == "checkpoint"] == committed

    fig = draw(series, width=1000, height=640)
    by_step, by_time = fig.axes[:2]
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert {"loss", "lr", "tokens/s", "world", "checkpoint", "restart (new attempt)"} <= set(lines)
    assert list(lines["loss"].get_xdata()) == series.step
    assert list(lines["loss"].get_ydata()) == pytest.approx(series.loss)
    assert list(lines["lr"].get_ydata()) == pytest.approx([kept[n]["lr"] for n in series.step])
    assert set(lines["world"].get_ydata()) == {2}
    checkpoints = [line for line in by_step.get_lines() if line.get_label() == "checkpoint"][0]
    assert list(checkpoints.get_xdata()) == committed and checkpoints.get_marker() == "v"
    assert by_step.get_xlabel() == "step" and by_time.get_xlabel().startswith("wall time")


def test_tensorboard_of_a_killed_and_resumed_run_holds_each_kept_step_once(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = os.path.join(resumed_run, "logs", "tensorboard")
    events = read_events(os.path.join(resumed_run, "logs", "events.jsonl"))
    # The leader only: one event file per attempt, none from rank 1.
    assert len(os.listdir(tb)) == len([e for e in events if e["event"] == "start"]) == 2
    acc = EventAccumulator(tb)
    acc.Reload()
    kept = kept_steps(events)
    for field, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("tokens_per_s", "train/tokens_per_s"),
                       ("world", "train/world")):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == sorted(kept), tag
        assert [v for _, v in got] == pytest.approx([kept[s][field] for s in sorted(kept)], rel=1e-6), tag
    assert [e.wall_time for e in acc.Scalars("train/loss")] == pytest.approx([kept[s]["t_end"] for s in sorted(kept)])
