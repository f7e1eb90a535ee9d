"""Every branch of the spot response policy (a pure function; the clock is an argument)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_ft.spot.policy import PolicySettings, Situation, decide
from elastic_ft.train.preemption import most_urgent
from elastic_ft.spot.watcher import Notice

NOW = 1_000.0
BASE = Situation(kind="terminate", deadline=NOW + 120, now=NOW, commit_s=2.0, steps_since_commit=7,
                 in_flight_covers_step=False, step_s=0.5)
DEFAULT = PolicySettings()


def at(**changes) -> Situation:
    return dataclasses.replace(BASE, **changes)


def test_no_notice_is_nothing():
    d = decide(at(kind=None), DEFAULT)
    assert (d.action, d.reason, d.leaves) == ("none", "no notice", False)


@pytest.mark.parametrize("kind", ["terminate", "stop", "hibernate", "sigterm"])
def test_a_leave_notice_commits_the_steps_since_the_last_commit_and_leaves(kind):
    d = decide(at(kind=kind), DEFAULT)
    assert d.action == "checkpoint_and_leave" and d.leaves
    assert d.reason == f"{kind}: commit 7 step(s) now; 120 s left, the last commit took 2.0 s: should fit"


def test_a_save_in_flight_of_the_current_step_is_flushed_not_repeated():
    d = decide(at(in_flight_covers_step=True, steps_since_commit=4), DEFAULT)
    assert d.action == "flush_and_leave" and "the save in flight covers the current step" in d.reason


def test_nothing_trained_since_the_last_commit_just_leaves():
    d = decide(at(steps_since_commit=0), DEFAULT)
    assert d.action == "flush_and_leave" and "nothing trained since the last commit" in d.reason


@pytest.mark.parametrize("changes, note", [
    ({"deadline": None}, "deadline unknown"),
    ({"deadline": NOW - 3}, "the deadline passed 3 s ago"),
    ({"commit_s": None}, "120 s left, commit time not measured yet"),
    ({"commit_s": 200.0}, "the last commit took 200.0 s: may not fit"),
])
def test_a_commit_is_attempted_whatever_the_time_left(changes, note):
    d = decide(at(**changes), DEFAULT)
    assert d.action == "checkpoint_and_leave" and d.reason.endswith(note)


def test_train_until_deadline_keeps_training_while_a_step_and_a_commit_fit():
    late = PolicySettings(train_until_deadline=True, margin_s=10.0)
    d = decide(at(deadline=NOW + 12.6), late)  # 0.5 + 2.0 + 10 = 12.5 s needed
    assert d.action == "none" and "another step and a commit need 12.5 s" in d.reason
    assert decide(at(deadline=NOW + 12.5), late).action == "checkpoint_and_leave"
    # Without a known deadline, commit time or step time there is nothing to weigh: leave now.
    for changes in ({"deadline": None}, {"commit_s": None}, {"step_s": None}):
        assert decide(at(**changes), late).action == "checkpoint_and_leave"


def test_rebalance_recommendation_checkpoints_early_without_leaving():
    d = decide(at(kind="rebalance", deadline=None), DEFAULT)
    assert d.action == "early_checkpoint" and not d.leaves and "7 step(s) since the last commit" in d.reason


@pytest.mark.parametrize("changes, settings, why", [
    ({}, PolicySettings(on_rebalance="ignore"), "ignored (spot.on_rebalance: ignore)"),
    ({"rebalance_handled": True}, DEFAULT, "already answered"),
    ({"in_flight_covers_step": True}, DEFAULT, "already saved"),
    ({"steps_since_commit": 0}, DEFAULT, "already saved"),
])
def test_rebalance_recommendation_that_needs_nothing(changes, settings, why):
    d = decide(at(kind="rebalance", deadline=None, **changes), settings)
    assert d.action == "none" and why in d.reason


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown notice kind 'reboot'"):
        decide(at(kind="reboot"), DEFAULT)


def test_most_urgent_notice_is_a_leave_with_the_earliest_known_deadline():
    reb = Notice("rebalance", None, 0.0, "r")
    unknown = Notice("terminate", None, 0.0, "t")
    soon = Notice("sigterm", 30.0, 0.0, "s")
    later = Notice("stop", 90.0, 0.0, "x")
    assert most_urgent([]) is None
    assert most_urgent([reb]) is reb
    assert most_urgent([reb, unknown]) is unknown
    assert most_urgent([later, reb, unknown, soon]) is soon
