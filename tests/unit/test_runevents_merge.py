"""The merge rule of a run's shipped events, the status summary and the etcd world (pure functions)."""

from __future__ import annotations

import json

from elastic_ft.runevents.goodput import attribute
from elastic_ft.runevents.layout import batch_key, parse_batch_key
from elastic_ft.runevents.live import world_from_keys
from elastic_ft.runevents.merge import latest_steps, merge
from elastic_ft.runevents.status import Checkpoint, LiveWorld, summary


def _ev(name: str, attempt: int, ts: float, **fields) -> dict:
    return {"ts": ts, "event": name, "run_id": "r", "attempt": attempt, **fields}


def _text(events: list[dict]) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


def _steps(attempt: int, steps: range, t0: float, world: int = 2) -> list[dict]:
    out = []
    for s in steps:
        t = t0 + s
        out += [_ev("step_done", attempt, t, step=s, seconds=0.5), _ev("ledger", attempt, t, step=s - 1, samples=[]),
                _ev("step", attempt, t, step=s, t_end=t, loss=1.0 / s, tokens=100, tokens_per_s=200.0, world=world,
                    eta_s=10.0 - s)]
    return out


def _two_attempts() -> tuple[list[tuple[str, str]], list[dict], list[dict]]:
    """Attempt 1 trains steps 1..6, commits 4 and ships twice, dies; attempt 2 resumes at 4, trains 5..8."""
    first = [_ev("start", 1, 0.0, world=2, total_steps=8, process_start=0.0), _ev("resume_plan", 1, 1.0, step=0),
             *_steps(1, range(1, 5), 1.0), _ev("checkpoint_committed", 1, 5.5, step=4), *_steps(1, range(5, 7), 1.0)]
    second = [_ev("start", 2, 20.0, world=1, total_steps=8, process_start=20.0),
              _ev("resume_plan", 2, 21.0, step=4), _ev("node_lost", 2, 21.0, reason="node 1 stopped heartbeating",
                                                        resume_after_step=4, world=1),
              *_steps(2, range(5, 9), 17.0, world=1), _ev("checkpoint_committed", 2, 26.0, step=8), _ev("end", 2, 26.1, step=8)]
    # Attempt 1 shipped at its commit (the events so far, steps 5-6 not yet), then at the next save's shipment
    # steps 5-6 (whose checkpoint never committed); attempt 2 shipped all at once.
    cut = first.index(next(e for e in first if e["event"] == "checkpoint_committed"))
    batches = [(batch_key(1, 0, "w1"), _text(first[:cut])), (batch_key(1, cut, "w1"), _text(first[cut:])),
               (batch_key(2, 0, "w2"), _text(second))]
    return batches, first, second


def test_batches_merge_in_attempt_then_emission_order_whatever_the_listing_order():
    batches, first, second = _two_attempts()
    assert merge(reversed(batches)) == first + second
    # A shipment retried after a lost reply, holding a prefix of a later one with the same first seq, adds nothing.
    again = [(batch_key(1, 0, "w1"), _text(first[:3]))]
    assert merge(batches[:1] + again + batches[1:]) == first + second
    # Objects that are not batches (claims, foreign keys) and lines that are not JSON objects are skipped.
    junk = [("events/attempts/00000001.json", '{"writer": "w1"}'), ("events/notes.txt", "x"),
            (batch_key(3, 0, "w3"), 'not json\n[1, 2]\n')]
    assert merge(batches + junk) == first + second


def test_every_step_once_the_latest_attempt_that_trained_it():
    batches, first, second = _two_attempts()
    kept = latest_steps(merge(batches))
    for name in ("step", "step_done"):
        assert [(e["step"], e["attempt"]) for e in kept if e["event"] == name] == [
            (1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2), (7, 2), (8, 2)]
    assert [(e["step"], e["attempt"]) for e in kept if e["event"] == "ledger"] == [
        (0, 1), (1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2), (7, 2)]
    others = [e for e in kept if e["event"] not in ("step", "step_done", "ledger")]
    assert others == [e for e in first + second if e["event"] not in ("step", "step_done", "ledger")]


def test_a_step_skipped_in_the_later_attempt_supersedes_the_first_trys_step_event():
    events = [_ev("start", 1, 0.0), *_steps(1, range(1, 3), 0.0), _ev("start", 2, 10.0),
              _ev("step_done", 2, 11.0, step=2, seconds=0.5), _ev("step_skipped", 2, 11.0, step=2, reason="nan")]
    kept = latest_steps(events)
    assert [(e["event"], e["attempt"]) for e in kept if e.get("step") == 2 and e["event"] != "ledger"] == [
        ("step_done", 2), ("step_skipped", 2)]


def test_batch_keys_round_trip_and_sort_in_order():
    keys = [batch_key(a, s, "abc") for a, s in ((2, 0), (1, 15), (1, 3), (10, 0))]
    assert [parse_batch_key(k)[:2] for k in sorted(keys)] == [(1, 3), (1, 15), (2, 0), (10, 0)]
    assert parse_batch_key("events/attempts/00000001.json") is None


def test_status_reports_progress_checkpoint_world_losses_goodput_and_speed():
    batches, _, _ = _two_attempts()
    events = merge(batches)
    lines = summary("s3://b/runs/r", events, Checkpoint(step=8, created=1000.0), committed=2, now=1090.0)
    text = "\n".join(lines)
    assert "steps: 8 of 8 (100.0 %); finished" in text
    assert "last checkpoint: step 8, committed 1m30s ago" in text and "2 committed" in text
    assert "world: 1 rank(s)" in text
    assert "attempts: 2; rescales: 0; preemptions: 0 (and 0 exit(s) on SIGTERM); nodes lost: 1; attempts cut short: 1" in text
    assert "node lost: node 1 stopped heartbeating; resumed after step 4 at world 1 (attempt 2)" in text
    assert f"goodput: {100 * attribute(events).goodput:.1f} %" in text
    assert "tokens/s: 200 (mean of the last 8 steps); ETA: done" in text
    live = summary("r", events[:10], None, committed=0, now=30.0, live=LiveWorld(round=3, world=4, nodes=2),
                   asked_rendezvous=True)
    assert "world: 4 rank(s) on 2 node(s) (rendezvous round 3, from etcd)" in live
    assert "last checkpoint: none committed" in live
    assert any(line.startswith("steps: 3 of 8 (37.5 %); running") for line in live)


def test_world_from_the_newest_rounds_assigned_ranks():
    p = "/elastic_ft/rendezvous/r/store/"
    keys = [f"{p}torch.rendezvous.r.{r}/torchelastic/{kind}/{i}" for r, n in ((2, 3), (3, 2))
            for kind in ("role_info", "assigned_ranks") for i in range(n)] + [f"{p}other", "/elastic_ft/x"]
    values = {k: json.dumps([0, 6 if ".2/" in k else 4, 0, 4]).encode() for k in keys if "assigned" in k}
    assert world_from_keys(p, "r", keys, values) == LiveWorld(round=3, world=4, nodes=2)
    assert world_from_keys(p, "r", [f"{p}other"], {}) is None
    assert world_from_keys(p, "other-run", keys, values) is None


def test_status_tells_spot_preemptions_from_exits_on_sigterm():
    events = [_ev("start", 1, 0.0, world=2, total_steps=8), _ev("preempted", 1, 5.0, step=3, notice="terminate"),
              _ev("start", 2, 9.0, world=1, total_steps=8), _ev("preempted", 2, 12.0, step=5, notice="sigterm"),
              _ev("start", 3, 15.0, world=2, total_steps=8)]
    text = "\n".join(summary("r", events, None, committed=0, now=20.0))
    assert "preemptions: 1 (and 1 exit(s) on SIGTERM); nodes lost: 0; attempts cut short: 0" in text
    assert "left at step 3 on a terminate notice (attempt 1), state committed" in text


def test_status_shows_padding_waste_from_the_steps_real_and_computed_tokens():
    batches, _, _ = _two_attempts()
    events = merge(batches)
    assert "padding: no step reported its tokens yet" in summary("r", events, None, committed=0, now=1.0)
    # Every step once, from the attempt that trained it last: attempt 1's steps 5 and 6 (retrained by
    # attempt 2) are not counted twice.
    for e in events:
        if e["event"] == "step":
            e.update(real_tokens=800, computed_tokens=1000 if e["attempt"] == 2 else 900)
    text = "\n".join(summary("r", events, None, committed=0, now=1.0))
    real, computed = 8 * 800, 4 * 900 + 4 * 1000
    assert (f"padding: {computed / real:.3f} tokens computed per real token "
            f"({100 * (computed - real) / computed:.1f} % of the computed tokens are padding; "
            f"6,400 real, 7,600 computed over 8 steps)") in text
