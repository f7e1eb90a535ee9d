"""checkpoint.every_steps: auto: Young/Daly's interval from the commit cost, the step time and the run's losses
(elastic_ft.train.checkpoint_interval), the history it reads (elastic_ft.runevents.attempt_history), and its
place in the cadence and the spec."""

import math
import os

import pytest
import yaml

from elastic_ft.config import CheckpointConfig, ConfigError, load_spec, spec_from_dict
from elastic_ft.config.limits import MAX_STEPS
from elastic_ft.runevents.attempt_history import AttemptHistory, summarize
from elastic_ft.train.cadence import checkpoint_due
from elastic_ft.train.checkpoint_interval import AutoInterval, choose_interval, material

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(ROOT, "specs", "tiny-lora.yaml")


def choose(commit_s=1.0, step_s=0.8, losses=0, exposure_s=0.0, prior=3600.0, **kw):
    return choose_interval(commit_s=commit_s, step_s=step_s, losses=losses, exposure_s=exposure_s,
                           prior_mtbf_s=prior, **kw)


def test_young_daly_from_the_measured_figures():
    # 3 losses in 41 min: MTBF 820 s; sqrt(2 * 1 * 820) = 40.5 s of training = 50.6 steps of 0.8 s.
    c = choose(commit_s=1.0, step_s=0.8, losses=3, exposure_s=41 * 60)
    assert c.steps == round(math.sqrt(2 * 1.0 * 820) / 0.8) == 51
    assert c.mtbf_s == pytest.approx(820)
    assert c.reason == "Young/Daly: C=1s, MTBF=820s (3 losses in 41 min), step 0.8 s -> every 51 steps"


def test_more_failures_give_a_shorter_interval():
    steps = [choose(losses=k, exposure_s=3600).steps for k in (1, 2, 4, 8, 16)]
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == len(steps)
    # A dearer commit is worth doing less often.
    assert choose(commit_s=4.0, losses=2, exposure_s=3600).steps > choose(commit_s=1.0, losses=2, exposure_s=3600).steps


def test_no_failure_uses_the_prior_until_the_run_outlasts_it():
    prior = choose(commit_s=2.0, step_s=1.0, prior=3600.0, exposure_s=600.0)
    assert prior.mtbf_s == 3600.0 and prior.steps == round(math.sqrt(2 * 2.0 * 3600.0))
    assert "no loss in 10 min; prior 60 min" in prior.reason
    later = choose(commit_s=2.0, step_s=1.0, prior=3600.0, exposure_s=4 * 3600.0)
    assert later.mtbf_s == 4 * 3600.0 and later.steps == 2 * prior.steps
    # The first loss after a long quiet stretch makes the interval shorter than the prior's.
    assert choose(commit_s=2.0, step_s=1.0, losses=1, exposure_s=600.0).steps < prior.steps


def test_free_commits_mean_every_step_and_the_bound_holds():
    free = choose(commit_s=0.0, losses=5, exposure_s=60.0)
    assert free.steps == 1 and "clamped to [1, " in free.reason
    assert choose(commit_s=1e-6, step_s=10.0, losses=100, exposure_s=10.0).steps == 1
    huge = choose(commit_s=1e4, step_s=1e-3, prior=1e8)
    assert huge.steps == MAX_STEPS and f"clamped to [1, {MAX_STEPS}]" in huge.reason
    assert choose(commit_s=1e4, step_s=1e-3, bound=500).steps == 500
    # A loss with no measured time (claims unreadable) does not divide by zero.
    assert choose(losses=2, exposure_s=0.0).steps >= 1


@pytest.mark.parametrize("bad", [dict(step_s=0.0), dict(step_s=math.nan), dict(commit_s=-1.0),
                                 dict(commit_s=math.inf)])
def test_figures_that_cannot_be_used_are_refused(bad):
    with pytest.raises(ValueError):
        choose(**bad)


def test_material_change():
    def at(ideal):
        return choose(commit_s=(ideal * 0.8) ** 2 / (2 * 3600.0))  # Young's ideal of ``ideal`` steps

    assert at(37.0).ideal == pytest.approx(37.0)
    assert material(None, at(7))
    assert not material(at(50), at(55)) and not material(at(50), at(42))
    assert material(at(50), at(60)) and material(at(50), at(40))
    # Short intervals: compared before rounding and by a whole step, 3.4 -> 3.6 or 2.9 -> 3.7 steps is
    # noise, 3 -> 4.5 is not.
    assert not material(at(3.4), at(3.6)) and not material(at(2.9), at(3.7)) and material(at(3.0), at(4.5))
    # Clamped at one step both: no change, however the ideal moves below it.
    assert not material(at(0.2), at(0.01))


# --------------------------------------------------------------------------- the history of attempts


def test_history_counts_attempts_that_ended_without_a_clean_exit():
    claims = {1: 1000.0, 2: 1100.0, 3: 1200.0, 4: 1500.0, 5: 2000.0}
    last = {
        1: [{"ts": 1090.0, "event": "step_done", "seconds": 0.5}],  # killed after shipping: a loss
        # 2: claimed, nothing shipped: killed before its first commit, a loss
        3: [{"ts": 1250.0, "event": "checkpoint_committed", "blocked_s": 0.02, "seconds": 1.0},
            {"ts": 1260.0, "event": "step_done", "seconds": 0.25}, {"ts": 1261.0, "event": "preempted"}],
        4: [{"ts": 1600.0, "event": "end"}],  # finished; rerun (5) much later: the gap is no exposure
    }
    h = summarize(claims, last, current=5)
    assert (h.attempts, h.losses) == (4, 2)
    assert h.exposure_s == pytest.approx(100 + 100 + 61 + 100)
    assert h.current_start == 2000.0 and h.commit_s == 0.02 and h.step_s == 0.25
    assert summarize({1: 5.0}, {}, current=1) == AttemptHistory(current_start=5.0)


# --------------------------------------------------------------------------- the interval as the run goes


class Events:
    def __init__(self):
        self.emitted = []

    def emit(self, event, **fields):
        self.emitted.append((event, fields))


def auto(**cfg):
    events = Events()
    return AutoInterval(CheckpointConfig(every_steps="auto", **cfg), leader=True, events=events), events


def test_the_leader_proposes_and_every_change_is_one_event():
    a, events = auto(auto_mtbf_s=3600.0)
    a.begin(AttemptHistory(current_start=0.0), now=0.0)
    assert a.propose(0.0, None, None) is None  # no step time yet: nothing to propose
    first = a.propose(1.0, 0.1, None)  # C unknown: one step assumed
    assert first == round(math.sqrt(2 * 0.1 * 3600) / 0.1)
    a.adopt(first, step=1)
    a.adopt(first, step=2)  # agreed again: no change, no event
    assert [e for e, _ in events.emitted] == ["checkpoint_interval"]
    assert events.emitted[0][1]["old"] is None and "assumed" in events.emitted[0][1]["reason"]
    # A save measured at 1 ms: the commit is much cheaper than a step, the interval much shorter.
    second = a.propose(2.0, 0.1, 0.001)
    assert second < first
    a.adopt(second, step=3)
    assert a.steps == second and events.emitted[-1][1] == {"step": 3, "old": first, "new": second,
                                                           "reason": events.emitted[-1][1]["reason"]}
    assert "C=0.001s" in events.emitted[-1][1]["reason"]
    # The same figures a little later: no material change, the current interval is proposed again.
    assert a.propose(3.0, 0.1, 0.001) == second and len(events.emitted) == 2


def test_a_restart_after_a_loss_proposes_a_shorter_interval():
    quiet, _ = auto()
    quiet.begin(AttemptHistory(current_start=0.0, commit_s=0.01, step_s=0.1), now=0.0)
    lost, _ = auto()
    lost.begin(AttemptHistory(attempts=1, losses=1, exposure_s=30.0, current_start=40.0, commit_s=0.01, step_s=0.1),
               now=40.0)
    assert lost.propose(41.0, None, None) < quiet.propose(1.0, None, None)


def test_inert_unless_auto_and_only_the_leader_proposes():
    off = AutoInterval(CheckpointConfig(every_steps=10), leader=True, events=Events())
    assert not off.enabled and off.propose(1.0, 0.1, 0.01) is None
    off.adopt(5, step=1)
    assert off.steps is None
    follower = AutoInterval(CheckpointConfig(every_steps="auto"), leader=False, events=Events())
    assert follower.propose(1.0, 0.1, 0.01) is None
    follower.adopt(12, step=4)  # the leader's value, agreed
    assert follower.steps == 12 and follower.events.emitted[0][1]["reason"] == "the leader's choice"


def test_the_cadence_follows_the_agreed_interval():
    cfg = CheckpointConfig(every_steps="auto", save_final=False)

    def due(step, interval):
        return checkpoint_due(step=step, total_steps=100, last_step=0, seconds_since=0.0, cfg=cfg, auto_steps=interval)

    assert [s for s in range(1, 50) if due(s, 12)[0]] == [12, 24, 36, 48]
    assert due(12, 12)[1] == "every 12 steps (auto)"
    assert not any(due(s, None)[0] for s in range(1, 100))  # before the first agreement: not by steps


# --------------------------------------------------------------------------- the spec


def _raw():
    with open(SPEC) as f:
        return yaml.safe_load(f)


def _problems(overrides):
    with pytest.raises(ConfigError) as info:
        spec_from_dict(_raw(), overrides, base_dir=os.path.dirname(SPEC))
    return dict(info.value.problems)


def test_auto_in_a_spec_file_and_as_an_override(tmp_path):
    text = open(SPEC).read().replace("../data/", os.path.join(ROOT, "data") + "/")
    path = tmp_path / "auto.yaml"
    path.write_text(text.replace("  every_steps: 20\n", "  every_steps: auto\n  auto_mtbf_s: 600\n"))
    spec = load_spec(str(path))
    assert (spec.checkpoint.every_steps, spec.checkpoint.auto_mtbf_s) == ("auto", 600.0)
    assert spec_from_dict(_raw(), ["checkpoint.every_steps=auto"], base_dir=os.path.dirname(SPEC)
                          ).checkpoint.every_steps == "auto"
    assert spec.hash() == load_spec(SPEC).hash()  # cadence is not part of the training's identity


@pytest.mark.parametrize("value, message", [
    ("sometimes", "must be int or 'auto', got 'sometimes'"),
    ("0", "must be in [1, 1000000000] or 'auto', got 0"),
    ("-3", "must be in [1, 1000000000] or 'auto', got -3"),
    ("2.5", "must be int or 'auto', got 2.5"),
    ("true", "must be int or 'auto', got True"),
])
def test_a_bad_interval_is_one_line_naming_the_field(value, message):
    assert _problems([f"checkpoint.every_steps={value}"]) == {"checkpoint.every_steps": message}


def test_auto_mtbf_is_bounded_and_keep_best_needs_fixed_steps():
    assert _problems(["checkpoint.auto_mtbf_s=10"]) == {
        "checkpoint.auto_mtbf_s": "must be in [60.0, 100000000.0], got 10.0"}
    probs = _problems(["checkpoint.every_steps=auto", "checkpoint.keep_best=true", "eval.every_steps=5",
                       "data.eval_fraction=0.1"])
    assert list(probs) == ["checkpoint.keep_best"] and "auto" in probs["checkpoint.keep_best"]


def test_history_read_from_a_real_store(tmp_path):
    # The layout the leaders write: attempt claims, then shipments; only each attempt's last one is read.
    from elastic_ft.checkpoint.store import open_store
    from elastic_ft.runevents.attempt_history import read_history
    from elastic_ft.runevents.layout import claim_attempt
    from elastic_ft.runevents.shipper import Shipper

    store = open_store(f"file://{tmp_path}/run")
    try:
        def attempt(*batches):
            n = claim_attempt(store)
            shipper = Shipper(store, n)
            for batch in batches:
                for event in batch:
                    shipper.write(event)
                shipper.ship()
            return n

        t = 1.8e9
        attempt([{"ts": t, "event": "start"}, {"ts": t + 1, "event": "step_done", "seconds": 0.5}],
                [{"ts": t + 2, "event": "checkpoint_committed", "blocked_s": 0.03}])  # killed after its commit
        attempt()  # killed before it shipped anything
        attempt([{"ts": t + 3, "event": "step_done", "seconds": 0.2}], [{"ts": t + 4, "event": "end"}])
        current = attempt()
        h = read_history(store, current)
        assert (h.attempts, h.losses, h.commit_s) == (3, 2, 0.03)
        assert h.current_start is not None and h.exposure_s >= 0
        assert read_history(store, current, window=1).losses == 0  # the newest attempt only: it finished
    finally:
        store.close()


def test_an_earlier_attempt_that_cannot_be_read_leaves_the_prior_and_the_start_goes_on(tmp_path):
    """The interval is advice: an earlier attempt's object that the history read cannot use (here a claim time
    no float holds) must not stop a start, nor every restart after it; the prior stands."""
    from elastic_ft.checkpoint.store import open_store
    from elastic_ft.runevents.layout import attempt_key, claim_attempt

    store = open_store(f"file://{tmp_path}/run")
    try:
        earlier = claim_attempt(store)
        store.put(attempt_key(earlier), b'{"claimed": 1' + b"0" * 400 + b"}")  # float() overflows
        current = claim_attempt(store)
        a, _ = auto(auto_mtbf_s=3600.0)
        a.start(store, current, now=0.0)
        assert a.propose(1.0, 0.1, 0.01) == round(math.sqrt(2 * 0.01 * 3600) / 0.1)  # the prior's interval
    finally:
        store.close()
