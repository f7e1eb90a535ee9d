"""The ``eval`` events in ``elastic-ft status`` and ``plot``'s series: the last evaluation of each step counts
(an evaluation redone after a restart supersedes the earlier try)."""

from __future__ import annotations

import math

from elastic_ft.runevents.status import kept_evals, summary
from elastic_ft.viz.series import run_series


def run_events() -> list[dict]:
    ts = iter(range(1000, 2000))
    e = lambda name, **f: {"event": name, "ts": float(next(ts)), **f}  # noqa: E731
    return [
        e("start", attempt=1, total_steps=6), e("resume_plan", attempt=1, step=0),
        e("step", attempt=1, step=1, loss=5.0, lr=1e-3), e("step", attempt=1, step=2, loss=4.5, lr=1e-3),
        e("eval", attempt=1, step=2, loss=4.75, tokens=700, samples=64),
        e("step", attempt=1, step=3, loss=4.2, lr=1e-3), e("step", attempt=1, step=4, loss=4.0, lr=1e-3),
        e("eval_abandoned", attempt=1, step=4, per_rank_done=1, per_rank=8),
        e("preempted", attempt=1, step=4, notice="terminate"),
        e("start", attempt=2, total_steps=6), e("resume_plan", attempt=2, step=4),
        e("eval", attempt=2, step=4, loss=4.25, tokens=700, samples=64),
        e("step", attempt=2, step=5, loss=3.9, lr=1e-3), e("step", attempt=2, step=6, loss=3.8, lr=1e-3),
        e("eval", attempt=2, step=6, loss=4.5, tokens=700, samples=64),
        e("eval", attempt=2, step=6, loss=4.3, tokens=700, samples=64),
    ]


def test_kept_evals_are_the_last_of_each_step():
    kept = kept_evals(run_events())
    assert {s: e["loss"] for s, e in kept.items()} == {2: 4.75, 4: 4.25, 6: 4.3}


def test_status_shows_the_last_eval_loss_and_the_lowest():
    lines = summary("r", run_events(), None, committed=0, now=3000.0)
    (line,) = [x for x in lines if x.startswith("eval loss:")]
    assert line == "eval loss: 4.3000 at step 6 (700 tokens); 3 evaluation(s); lowest 4.2500 at step 4"
    no_eval = [e for e in run_events() if e["event"] != "eval"]
    assert not [x for x in summary("r", no_eval, None, committed=0, now=3000.0) if x.startswith("eval")]


def test_plot_series_has_the_eval_losses():
    s = run_series(run_events())
    assert (s.eval_step, s.eval_loss) == ([2, 4, 6], [4.75, 4.25, 4.3])
    nan = run_events()
    nan[-1]["loss"] = "nan"
    assert math.isnan(run_series(nan).eval_loss[-1])


def test_the_plot_draws_the_eval_losses(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    from elastic_ft.viz.figure import draw

    fig = draw(run_series(run_events()))
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    eval_line = lines["eval loss (held out)"]
    assert list(eval_line.get_xdata()) == [2, 4, 6] and list(eval_line.get_ydata()) == [4.75, 4.25, 4.3]
