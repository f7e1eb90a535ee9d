"""bench/recovery.py's reading of a run's events: which step is the new world's first after a preemption."""

from __future__ import annotations

from bench import recovery


def test_a_carried_step_is_not_the_new_worlds_first_step():
    """At a resume from a node's kept step the new leader writes the lost leader's last steps again
    (``carried``) before its resume plan: the new world's first step is the one it trains after that."""
    events = [
        {"event": "start", "ts": 10.0, "world": 3},
        {"event": "step_done", "ts": 11.0, "step": 41, "seconds": 0.1},
        {"event": "step_done", "ts": 11.1, "step": 42, "seconds": 0.1},
        {"event": "start", "ts": 20.0, "world": 2},
        {"event": "step_done", "ts": 20.5, "step": 42, "seconds": 0.1, "carried": True},
        {"event": "resume_plan", "ts": 20.6, "step": 42},
        {"event": "step_done", "ts": 20.9, "step": 43, "seconds": 0.3},
    ]
    assert recovery.first_step_after(events, 15.0) == (3, 6)
    r = recovery.recovery("kill", 15.0, events, marks=[])
    assert r.lost == 0 and r.total == 20.9 - 15.0 and r.worlds == (3, 2)
