"""The sample ledger (elastic_ft.runevents.ledger) and the fault spec (elastic_ft.train.faults)."""

import pytest

from elastic_ft.train import faults
from elastic_ft.runevents.ledger import check_exactly_once, replay
from elastic_ft.train.cursor import deal, take


def ledger_events(first_step, steps, *, cursor, global_batch, world, n, seed=0):
    out = []
    for step in range(first_step, first_step + steps):
        positions = take(cursor, global_batch, n, seed)
        sizes = [global_batch // world + (1 if r < global_batch % world else 0) for r in range(world)]
        out.append({"event": "ledger", "step": step, "samples": [[list(p) for p in mine] for mine in deal(positions, sizes)]})
        cursor += global_batch
    return out


def test_replay_cuts_steps_after_a_resume():
    n, gb = 10, 4
    events = [{"event": "start"}, {"event": "resume_plan", "step": 0}]
    events += ledger_events(0, 5, cursor=0, global_batch=gb, world=2, n=n)  # steps 0..4
    # crash, restart from the checkpoint at step 3 with one rank: steps 3 and 4 redone
    events += [{"event": "resume_plan", "step": 3}]
    events += ledger_events(3, 2, cursor=3 * gb, global_batch=gb, world=1, n=n)
    history = replay(events)
    assert list(history) == [0, 1, 2, 3, 4]
    assert sum(len(v) for v in history.values()) == 5 * gb
    assert [p for s in history for p in history[s]] == [tuple(p) for p in take(0, 5 * gb, n, 0)]
    assert check_exactly_once(history, n) == []


def test_replay_drops_steps_a_failed_attempt_logged_past_its_checkpoint():
    events = ledger_events(0, 4, cursor=0, global_batch=2, world=2, n=8)
    events.append({"event": "resume_plan", "step": 2})
    history = replay(events)
    assert list(history) == [0, 1]


def test_exactly_once_detects_duplicates():
    history = {0: [(0, 1), (0, 2)], 1: [(0, 3), (0, 1)]}
    problems = check_exactly_once(history, 4)
    assert problems == ["sample 1 of epoch 0 consumed twice (again at step 1)"]


def test_exactly_once_detects_missing_steps():
    history = {0: [(0, 0)], 2: [(0, 2)], 5: [(0, 3)]}
    problems = check_exactly_once(history, 10)
    assert problems == ["steps missing from the ledger: [1, 3, 4]"]


def test_exactly_once_detects_incomplete_epoch():
    # epoch 0 has only 3 of 4 samples but epoch 1 has started
    history = {0: [(0, 0), (0, 1)], 1: [(0, 2), (1, 0)]}
    assert check_exactly_once(history, 4) == ["epoch 0 consumed 3 of 4 samples"]
    # the last (current) epoch may be partial
    assert check_exactly_once({0: [(0, 0), (0, 1)]}, 4) == []


def test_exactly_once_passes_a_two_epoch_run():
    events = ledger_events(0, 5, cursor=0, global_batch=4, world=3, n=8)  # 20 samples: 2.5 epochs
    assert check_exactly_once(replay(events), 8) == []


def test_fault_parse():
    got = faults.parse("kill:rank=1,step=7,restart=0; kill:step=3")
    assert got == [faults.Fault("kill", 1, 7, 0), faults.Fault("kill", None, 3, None)]
    assert faults.parse("") == [] and faults.parse(" ; ") == []
    assert faults.parse("fail_load:rank=1") == [faults.Fault("fail_load", 1, None, None)]
    assert faults.parse("kill_build:rank=1,restart=0; kill_build:rank=0,point=commit") == [
        faults.Fault("kill_build", 1, None, 0, "share"), faults.Fault("kill_build", 0, None, None, "commit")]


def test_fail_load_raises_on_its_rank_only():
    injector = faults.Injector(faults.parse("fail_load:rank=1,restart=0"), restart=0)
    injector.maybe_fail_load(rank=0)
    injector.maybe_fire(rank=1, step=0)  # not a kill
    with pytest.raises(OSError, match="rank 1"):
        injector.maybe_fail_load(rank=1)
    faults.Injector(faults.parse("fail_load:rank=1,restart=0"), restart=1).maybe_fail_load(rank=1)


@pytest.mark.parametrize("text,match", [
    ("stop:step=1", "unknown fault action 'stop'"),
    ("kill:rank=1", "needs step=N"),
    ("kill:step=1,node=2", "accepts only rank, step, restart"),
    ("kill", "needs step=N"),
    ("fail_load:rank=1,step=2", "accepts only rank and restart"),
    ("kill_build:rank=1,step=2", "accepts only rank, restart and point=share|commit"),
    ("kill_build:point=later", "accepts only rank, restart and point=share|commit"),
    ("kill_build:rank=1,point", "accepts only rank, restart and point=share|commit"),
])
def test_fault_parse_errors(text, match):
    with pytest.raises(ValueError, match=match) as info:
        faults.parse(text)
    assert faults.ENV in str(info.value)


@pytest.mark.parametrize("text,match", [
    ("kill:step=x", "not an integer"), ("kill:rank=one,step=1", "not an integer"), ("kill:step", "needs step=N"),
    ("kill:step=1,rank", "needs step=N"), ("kill:step=1,step=2", "needs step=N"),
])
def test_fault_parse_malformed_values(text, match):
    with pytest.raises(ValueError, match=match) as info:
        faults.parse(text)
    assert info.value.args[0].startswith(f"{faults.ENV}: {text!r}")


def test_injector_matches_rank_step_restart(monkeypatch):
    fired = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: fired.append(sig))
    inj = faults.Injector(faults.parse("kill:rank=1,step=7,restart=0"), restart=0)
    inj.maybe_fire(rank=0, step=7)
    inj.maybe_fire(rank=1, step=6)
    assert fired == []
    inj.maybe_fire(rank=1, step=7)
    assert fired == [faults.signal.SIGKILL]
    faults.Injector(faults.parse("kill:rank=1,step=7,restart=0"), restart=1).maybe_fire(rank=1, step=7)
    assert len(fired) == 1
