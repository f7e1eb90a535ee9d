"""What ``elastic-ft plot`` draws, from hand-made event lists (elastic_ft.viz.series, no matplotlib), and the
command's answers to bad arguments and a missing matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic_ft import cli
from elastic_ft.viz.series import by_attempt, run_series


def ev(ts: float, event: str, attempt: int, **fields) -> dict:
    return {"ts": ts, "event": event, "run_id": "r", "attempt": attempt, **fields}


def step(t: float, attempt: int, n: int, loss: float, world: int = 2) -> dict:
    return ev(t + 0.01, "step", attempt, step=n, t_end=t, loss=loss, lr=1e-3 * n, tokens_per_s=100.0 * world,
              world=world)


def preempted_and_rescaled() -> list[dict]:
    """Two attempts: the first trains 1..5, commits 2 and 4, leaves on a notice at 5; the second resumes
    after 4 at world 1 (a rescale), after its agent saw the node go."""
    return [
        ev(10.0, "start", 1, world=2, total_steps=7, agent_start=8.0, process_start=9.0),
        ev(11.0, "resume_plan", 1, step=0),
        step(12.0, 1, 1, 5.0), step(13.0, 1, 2, 4.8),
        ev(13.2, "checkpoint_committed", 1, step=2),
        step(14.0, 1, 3, 4.6), step(15.0, 1, 4, 4.4),
        ev(15.2, "checkpoint_committed", 1, step=4),
        step(16.0, 1, 5, 4.3),
        ev(16.5, "preempted", 1, step=5, notice="termination"),
        ev(30.0, "start", 2, world=1, total_steps=7, process_start=29.0),
        ev(31.0, "resume_plan", 2, step=4),
        ev(31.0, "rescale", 2, step=4, changed={"world": {"old": 2, "new": 1}}, reason="world changed"),
        ev(31.1, "node_lost", 2, reason="node b left", resume_after_step=4, world=1),
        step(33.0, 2, 5, 4.25, world=1), step(35.0, 2, 6, 4.1, world=1), step(37.0, 2, 7, 4.0, world=1),
        ev(37.2, "checkpoint_committed", 2, step=7),
        ev(37.3, "end", 2, step=7),
    ]


def test_each_step_is_drawn_once_from_the_try_the_run_kept():
    s = run_series(preempted_and_rescaled())
    assert (s.run_id, s.total_steps, s.attempts, s.t0) == ("r", 7, 2, 8.0)
    assert s.step == [1, 2, 3, 4, 5, 6, 7]
    assert s.loss == [5.0, 4.8, 4.6, 4.4, 4.25, 4.1, 4.0]  # step 5 from the second attempt
    assert s.lr == pytest.approx([1e-3 * n for n in s.step])
    assert (s.redone_step, s.redone_loss) == ([5], [4.3])
    assert s.loss_at(4) == 4.4 and s.loss_at(0) is None


def test_throughput_and_world_are_one_segment_per_attempt_on_the_run_clock():
    s = run_series(preempted_and_rescaled())
    assert [seg.attempt for seg in s.segments] == [1, 2]
    first, second = s.segments
    assert first.t == pytest.approx([4.0, 5.0, 6.0, 7.0, 8.0])  # t_end - the agent's start
    assert (first.world, second.world) == ([2] * 5, [1] * 3)
    assert second.tokens_per_s == [100.0] * 3 and second.t == pytest.approx([25.0, 27.0, 29.0])


def test_checkpoints_preemptions_rescales_and_restarts_are_marked():
    marks = [(m.kind, m.step, round(m.t, 3)) for m in run_series(preempted_and_rescaled()).marks]
    assert marks == [
        ("checkpoint", 2, 5.2), ("checkpoint", 4, 7.2), ("preempted", 5, 8.5),
        ("restart", 4, 22.0), ("rescale", 4, 23.0),
        ("node_lost", 5, 8.5),  # where the previous attempt stopped, not where the next one said so
        ("checkpoint", 7, 29.2),
    ]


def test_killed_attempt_steps_past_the_resume_point_are_redone_even_before_they_are_trained_again():
    events = [
        ev(1.0, "start", 1, total_steps=10), ev(1.5, "resume_plan", 1, step=0),
        step(2.0, 1, 1, 3.0), step(3.0, 1, 2, 2.9), step(4.0, 1, 3, 2.8),
        ev(9.0, "start", 2, total_steps=10), ev(9.5, "resume_plan", 2, step=1),
        step(10.0, 2, 2, 2.95),  # killed again: step 3 of attempt 1 is lost all the same
    ]
    s = run_series(events)
    assert (s.step, s.loss) == ([1, 2], [3.0, 2.95])
    assert (s.redone_step, s.redone_loss) == ([2, 3], [2.9, 2.8])


def test_events_without_an_attempt_field_are_grouped_by_their_start_events():
    events = [{k: v for k, v in e.items() if k != "attempt"} for e in preempted_and_rescaled()]
    assert [len(a) for a in by_attempt(events)] == [10, 9]
    assert run_series(events).redone_step == [5]


def test_a_run_with_no_step_yet_has_empty_series():
    s = run_series([ev(1.0, "start", 1, total_steps=3)])
    assert (s.step, s.segments, s.marks, s.attempts) == ([], [], [], 1)


def test_the_figure_draws_the_series_and_a_line_at_each_preemption_rescale_and_restart(tmp_path):
    from elastic_ft.viz.figure import draw, render

    s = run_series(preempted_and_rescaled())
    fig = draw(s, width=900, height=600)
    by_step, by_time = fig.axes[:2]
    for ax, at in ((by_step, "step"), (by_time, "t")):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for label, kind in (("preemption (spot notice)", "preempted"), ("node lost", "node_lost"),
                            ("rescale", "rescale"), ("restart (new attempt)", "restart")):
            assert list(lines[label].get_xdata()) == [getattr(m, at) for m in s.marks if m.kind == kind] * 2, label
    redone = next(line for line in by_step.get_lines() if line.get_label().startswith("loss (a try lost"))
    assert (list(redone.get_xdata()), list(redone.get_ydata())) == ([5], [4.3])
    render(s, str(tmp_path / "run.png"), width=900, height=600)
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_events(path, events) -> str:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


def test_plot_refuses_an_out_that_cannot_be_written_and_a_silly_size(tmp_path, capsys):
    events = write_events(tmp_path / "events.jsonl", preempted_and_rescaled())
    assert cli.main(["plot", events, "--out", str(tmp_path)]) == 2
    assert "plot --out" in capsys.readouterr().err
    assert cli.main(["plot", events, "--out", str(tmp_path / "no" / "run.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "nothing"), "--out", str(tmp_path / "run.png")]) == 2
    assert "plot: no events.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plot", events, "--out", str(tmp_path / "run.png"), "--width", "5"])
    assert "--width" in capsys.readouterr().err


@pytest.mark.subprocess
def test_plot_without_matplotlib_says_which_extra_to_install(tmp_path):
    events = write_events(tmp_path / "events.jsonl", preempted_and_rescaled())
    # A real process where matplotlib cannot be imported (as on a node without the plot extra).
    code = ("import sys; sys.modules['matplotlib'] = None; from elastic_ft.cli import main; "
            f"sys.exit(main(['plot', {events!r}, '--out', {str(tmp_path / 'run.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("elastic-ft: error: plot needs matplotlib, which is not installed: "
                                   "pip install 'elastic-ft[plot]'")
    assert not (tmp_path / "run.png").exists()
