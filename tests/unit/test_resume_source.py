"""The resume source decision (pure): a survivor's kept step or the newest commit, with the reason."""

from __future__ import annotations

import pytest

from elastic_ft.train.resume_source import (
    CHECKPOINT, MEMORY, REPORT_WIDTH, Held, ResumeSource, choose_source, decode, encode,
)

ME = 1234567


def test_first_start_nothing_held_nothing_committed_is_the_checkpoint_path():
    s = choose_source([None, None, None], committed_step=None, identity=ME)
    assert s.kind == CHECKPOINT and s.rank is None
    assert "no node of this world holds a kept step" in s.reason


def test_whole_job_restart_nothing_held_resumes_from_the_commit():
    s = choose_source([None, None], committed_step=40, identity=ME)
    assert s.kind == CHECKPOINT and "no node" in s.reason


def test_newest_held_step_newer_than_the_commit_wins_lowest_rank_among_equals():
    reports = [None, Held(17, ME, node=1), Held(18, ME, node=2), None, Held(18, ME, node=3)]
    s = choose_source(reports, committed_step=10, identity=ME)
    assert (s.kind, s.rank, s.node, s.step, s.committed_step) == (MEMORY, 2, 2, 18, 10)
    assert s.reason == "node 2 holds step 18 in memory; the newest commit is step 10"


def test_held_at_the_committed_step_is_sent_rather_than_read_from_the_store():
    s = choose_source([Held(10, ME, node=0)], committed_step=10, identity=ME)
    assert (s.kind, s.step) == (MEMORY, 10)


def test_held_with_nothing_committed_is_memory():
    s = choose_source([None, Held(3, ME, node=1)], committed_step=None, identity=ME)
    assert (s.kind, s.rank) == (MEMORY, 1) and "nothing is committed" in s.reason


def test_held_older_than_the_commit_is_the_checkpoint():
    s = choose_source([Held(9, ME, node=0)], committed_step=10, identity=ME)
    assert s.kind == CHECKPOINT
    assert s.reason == "the newest kept step 9 is older than the newest commit (step 10)"


def test_a_foreign_state_is_never_chosen_even_when_newer():
    s = choose_source([Held(99, ME + 1, node=0), None], committed_step=10, identity=ME)
    assert s.kind == CHECKPOINT and "another run or training config" in s.reason
    # ... and a newer foreign one does not hide an older one of ours
    s = choose_source([Held(99, ME + 1, node=0), Held(12, ME, node=1)], committed_step=10, identity=ME)
    assert (s.kind, s.rank, s.step) == (MEMORY, 1, 12)


def test_off_and_fsdp_go_to_the_checkpoint_and_say_why():
    held = [Held(50, ME, node=0)]
    off = choose_source(held, committed_step=10, identity=ME, enabled=False)
    assert off.kind == CHECKPOINT and "keep_step_in_memory is off" in off.reason
    fsdp = choose_source(held, committed_step=10, identity=ME, strategy="fsdp")
    assert fsdp.kind == CHECKPOINT and "fsdp" in fsdp.reason and "lost node takes part of the state" in fsdp.reason


@pytest.mark.parametrize("held", [None, Held(7, 2**62 + 5, node=3)])
def test_reports_round_trip_through_fixed_width_rows(held):
    row = encode(held)
    assert len(row) == REPORT_WIDTH and all(isinstance(x, int) for x in row)
    assert decode(row) == held


def test_the_event_names_the_source_holder_and_reason():
    s = choose_source([Held(5, ME, node=1)], committed_step=None, identity=ME)
    assert s.event() == {"origin": "memory", "origin_reason": s.reason, "committed_step": None,
                         "holder": {"rank": 0, "node": 1, "step": 5, "host": None}}
    assert ResumeSource(CHECKPOINT, "why").event() == {"origin": "checkpoint", "origin_reason": "why",
                                                       "committed_step": None}
