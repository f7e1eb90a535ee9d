"""The non-finite step guard's decisions, the nan_* faults, and the spec fields that bound both."""

import math

import pytest

from elastic_ft.train import faults
from elastic_ft.config import ConfigError, spec_from_dict
from elastic_ft.train.guard import NonFiniteGuard

BASE = {"model": {"config": {"model_type": "llama"}}, "data": {"files": ["x.jsonl"]}, "steps": 10}


def test_guard_skips_non_finite_steps_and_counts_them_in_a_row():
    g = NonFiniteGuard(limit=3)
    assert g.observe(1.5, 2.0) is None
    assert g.observe(math.nan, math.nan) == "gradient norm nan, loss nan"
    assert g.observe(math.inf, 3.0) == "gradient norm inf"
    assert (g.in_row, g.total, g.exhausted) == (2, 2, False)
    assert g.observe(0.7, 2.0) is None  # a finite step starts the count again
    assert (g.in_row, g.total) == (0, 2)
    for _ in range(3):
        g.observe(math.nan, 1.0)
    assert g.exhausted and g.total == 5
    msg = g.abort_message(12)
    assert msg.startswith("training stopped at step 12: 3 step(s) in a row had a non-finite loss or gradient "
                          "(optimizer.max_nonfinite_steps=3); the last: gradient norm nan")


def test_a_finite_norm_decides_even_if_the_local_loss_is_not():
    # The norm is the same on every rank; this rank's loss is not, so it must not decide.
    g = NonFiniteGuard(limit=1)
    assert g.observe(0.5, math.nan) is None and not g.exhausted


def test_nan_faults_parse_and_fire_by_rank_and_step():
    inj = faults.Injector(faults.parse("nan_loss:rank=1,step=4; nan_weight:step=6,restart=0"), restart=0)
    assert inj.fires("nan_loss", rank=1, step=4)
    assert not inj.fires("nan_loss", rank=0, step=4) and not inj.fires("nan_weight", rank=1, step=4)
    assert inj.fires("nan_weight", rank=3, step=6)
    assert not faults.Injector(inj.faults, restart=1).fires("nan_weight", rank=0, step=6)


@pytest.mark.parametrize("text", ["nan_loss:rank=1", "nan_weight:step=2,steps=3", "nan_loss:step=2,oops"])
def test_nan_faults_without_a_step_or_with_unknown_fields_are_refused(text):
    """Such a fault would never fire: a drill that silently tests nothing."""
    with pytest.raises(ValueError, match="needs step=N"):
        faults.parse(text)


def test_nan_faults_do_not_kill(monkeypatch):
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: pytest.fail("a nan fault killed the process"))
    faults.Injector(faults.parse("nan_loss:step=1;nan_weight:step=1"), restart=0).maybe_fire(rank=0, step=1)


@pytest.mark.parametrize("field,value,msg", [
    ("optimizer.max_nonfinite_steps", 0, "must be in [1, 1000], got 0"),
    ("optimizer.max_nonfinite_steps", 10**9, "must be in [1, 1000], got 1000000000"),
    ("checkpoint.max_failed_saves", 0, "must be in [1, 100], got 0"),
    ("checkpoint.max_failed_saves", -2, "must be in [1, 100], got -2"),
    ("checkpoint.save_timeout_s", 0, "must be in [1.0, 86400.0], got 0.0"),
    ("checkpoint.save_timeout_s", ".nan", "must be a finite number, got nan"),
    ("checkpoint.save_timeout_s", "1e308", "must be in [1.0, 86400.0], got 1e+308"),
])
def test_guard_limits_are_bounded(field, value, msg):
    with pytest.raises(ConfigError) as info:
        spec_from_dict(BASE, [f"{field}={value}"], check_files=False)
    assert (field, msg) in info.value.problems


def test_guard_limits_default_and_leave_the_config_hash_alone():
    spec = spec_from_dict(BASE, check_files=False)
    assert (spec.optimizer.max_nonfinite_steps, spec.checkpoint.max_failed_saves, spec.checkpoint.save_timeout_s) == (
        3, 3, 1800.0)
    other = spec_from_dict(BASE, ["optimizer.max_nonfinite_steps=50"], check_files=False)
    assert other.hash() == spec.hash(), "a guard's limit made the checkpoint look like another training"
