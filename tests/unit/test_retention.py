"""Retention planning (elastic_ft.checkpoint.retention.plan_gc): a pure function
of the store listing, the policy and the clock."""

import math

import pytest

from elastic_ft.checkpoint.manifest import manifest_key
from elastic_ft.checkpoint.retention import RetentionPolicy, plan_gc
from elastic_ft.checkpoint.store import ObjectInfo

NOW = 1_000_000.0


def store_of(steps, *, shared=(), orphans=(), age=10.0):
    """Manifests at ``steps`` each with two own blobs (plus ``shared`` blobs in all),
    and the blob listing with every blob ``age`` seconds old; ``orphans`` are
    (key, age) pairs referenced by no manifest."""
    manifests, listing = {}, []
    for s in steps:
        own = {f"blobs/{s:012d}-n/model.safetensors", f"blobs/{s:012d}-n/trainer.json"}
        manifests[s] = (manifest_key(s), own | set(shared))
        listing += [ObjectInfo(k, 100, NOW - age) for k in sorted(own)]
    listing += [ObjectInfo(k, 100, NOW - age) for k in shared]
    listing += [ObjectInfo(k, 100, NOW - a) for k, a in orphans]
    return manifests, listing


def deleted(plan):
    return {d.key for d in plan.manifests}, {d.key for d in plan.blobs}


def test_keep_last():
    manifests, blobs = store_of([10, 20, 30, 40, 50])
    plan = plan_gc(manifests, blobs, RetentionPolicy(keep_last=2), NOW)
    assert plan.kept_steps == [40, 50]
    gone_m, gone_b = deleted(plan)
    assert gone_m == {manifest_key(s) for s in (10, 20, 30)}
    assert gone_b == set().union(*(manifests[s][1] for s in (10, 20, 30)))
    assert all("referenced only by deleted" in d.reason for d in plan.blobs)
    assert all("past retention" in d.reason for d in plan.manifests)


def test_keep_all_when_keep_last_is_none():
    manifests, blobs = store_of([1, 2, 3])
    plan = plan_gc(manifests, blobs, RetentionPolicy(keep_last=None), NOW)
    assert plan.kept_steps == [1, 2, 3] and plan.manifests == [] and plan.blobs == []


def test_keep_every():
    manifests, blobs = store_of([10, 20, 30, 40, 50, 60])
    plan = plan_gc(manifests, blobs, RetentionPolicy(keep_last=1, keep_every=20), NOW)
    assert plan.kept_steps == [20, 40, 60]
    gone_m, _ = deleted(plan)
    assert gone_m == {manifest_key(s) for s in (10, 30, 50)}


def test_newest_always_kept():
    manifests, blobs = store_of([3, 7, 11])
    plan = plan_gc(manifests, blobs, RetentionPolicy(keep_last=1, keep_every=5), NOW)
    assert 11 in plan.kept_steps
    assert manifest_key(11) not in deleted(plan)[0]
    assert plan.kept_steps == [11]


@pytest.mark.parametrize("field,value,expected", [
    ("keep_last", -5, "keep_last must be in [1, 1000000], got -5"),
    ("keep_last", 0, "keep_last must be in [1, 1000000], got 0"),
    ("keep_every", 0, "keep_every must be in [1, 1000000000], got 0"),
    ("keep_every", -2, "keep_every must be in [1, 1000000000], got -2"),
    ("orphan_grace_s", -100.0, "orphan_grace_s must be in [0.0, 100000000.0], got -100.0"),
    ("orphan_grace_s", math.nan, "orphan_grace_s must be in"),
    ("orphan_grace_s", math.inf, "orphan_grace_s must be in"),
])
def test_policy_refuses_values_outside_the_spec_range(field, value, expected):
    # keep_last=-5 once deleted every checkpoint but the newest; a negative grace deletes a save in flight.
    with pytest.raises(ValueError) as info:
        RetentionPolicy(**{field: value})
    assert expected in str(info.value)


def _bypassing_validation(**fields):
    """A policy holding values validation refuses, as a caller that skipped it would build."""
    policy = RetentionPolicy()
    for k, v in fields.items():
        object.__setattr__(policy, k, v)
    return policy


POLICIES = [RetentionPolicy(keep_last=k, keep_every=e, orphan_grace_s=g)
            for k in (None, 1, 2, 5) for e in (None, 1, 3, 7) for g in (0.0, 3600.0)]
POLICIES += [_bypassing_validation(keep_last=k, keep_every=e, orphan_grace_s=g)
             for k in (0, -1, -5) for e in (None, 0, -3) for g in (0.0, -100.0, -math.inf)]


@pytest.mark.parametrize("steps", [[5], [3, 7, 11], [2, 4, 6, 8, 10, 12]])
def test_newest_checkpoint_and_its_blobs_survive_every_policy(steps):
    manifests, blobs = store_of(steps, shared=("blobs/base/shared.json",), age=10 * 86400)
    newest = max(steps)
    for policy in POLICIES:
        plan = plan_gc(manifests, blobs, policy, NOW)
        gone_m, gone_b = deleted(plan)
        assert newest in plan.kept_steps, policy
        assert manifest_key(newest) not in gone_m, policy
        assert not gone_b & manifests[newest][1], policy


def test_blobs_of_kept_manifests_never_deleted_even_if_shared_or_old():
    shared = ("blobs/base/shared.json",)
    manifests, blobs = store_of([1, 2, 3], shared=shared, age=10 * 86400)
    plan = plan_gc(manifests, blobs, RetentionPolicy(keep_last=1, orphan_grace_s=1), NOW)
    _, gone_b = deleted(plan)
    assert not gone_b & manifests[3][1]
    assert "blobs/base/shared.json" not in gone_b
    assert gone_b == (manifests[1][1] | manifests[2][1]) - set(shared)


def test_orphans_deleted_only_after_grace():
    orphans = [("blobs/000000000099-x/model.safetensors", 30.0), ("blobs/000000000098-y/model.safetensors", 7200.0)]
    manifests, blobs = store_of([5], orphans=orphans)
    plan = plan_gc(manifests, blobs, RetentionPolicy(keep_last=3, orphan_grace_s=3600), NOW)
    _, gone_b = deleted(plan)
    assert gone_b == {"blobs/000000000098-y/model.safetensors"}  # the young one may be a save in flight
    (d,) = plan.blobs
    assert "orphan" in d.reason and "7200s" in d.reason
    # the same store an hour later: now both are past grace
    later = plan_gc(manifests, blobs, RetentionPolicy(keep_last=3, orphan_grace_s=3600), NOW + 3600)
    assert deleted(later)[1] == {k for k, _ in orphans}


def test_objects_outside_blobs_prefix_are_ignored():
    manifests, blobs = store_of([1], orphans=[("manifests/tmp-abc", 10**6), ("README", 10**6)])
    plan = plan_gc(manifests, blobs, RetentionPolicy(orphan_grace_s=0), NOW)
    assert plan.blobs == [] and plan.manifests == []


def test_empty_store():
    plan = plan_gc({}, [ObjectInfo("blobs/x/y", 1, NOW - 10)], RetentionPolicy(orphan_grace_s=5), NOW)
    assert plan.kept_steps == [] and plan.manifests == []
    assert [d.key for d in plan.blobs] == ["blobs/x/y"]


def test_plan_lines_are_printable():
    manifests, blobs = store_of([1, 2])
    lines = plan_gc(manifests, blobs, RetentionPolicy(keep_last=1), NOW).lines()
    assert lines[0] == "keep checkpoints at steps [2]"
    assert f"delete {manifest_key(1)}" in lines[1]


# keep_best: the checkpoint with the lowest eval loss its manifest records is kept out of retention.

def test_keep_best_keeps_the_lowest_eval_loss_past_keep_last():
    manifests, blobs = store_of([10, 20, 30, 40, 50])
    losses = {10: 3.0, 20: 1.5, 30: 2.0, 40: None, 50: 2.5}
    plan = plan_gc(manifests, blobs, RetentionPolicy(keep_last=1, keep_best=True), NOW, losses)
    assert plan.kept_steps == [20, 50]
    gone_m, gone_b = deleted(plan)
    assert gone_m == {manifest_key(s) for s in (10, 30, 40)}
    assert not gone_b & manifests[20][1], "a blob of the best checkpoint was deleted"
    # Without keep_best the same losses change nothing: the best goes with the others.
    plain = plan_gc(manifests, blobs, RetentionPolicy(keep_last=1), NOW, losses)
    assert plain.kept_steps == [50]


def test_keep_best_follows_a_new_best_and_skips_non_finite_losses():
    manifests, blobs = store_of([10, 20, 30])
    policy = RetentionPolicy(keep_last=1, keep_best=True)
    assert plan_gc(manifests, blobs, policy, NOW, {10: 2.0, 20: float("nan"), 30: None}).kept_steps == [10, 30]
    assert plan_gc(manifests, blobs, policy, NOW, {10: 2.0, 20: 1.0, 30: None}).kept_steps == [20, 30]
    assert plan_gc(manifests, blobs, policy, NOW, {10: 1.0, 20: 1.0, 30: 5.0}).kept_steps == [10, 30]  # earliest tie
    assert plan_gc(manifests, blobs, policy, NOW, {10: float("inf")}).kept_steps == [30]  # no finite loss: no best
    assert plan_gc(manifests, blobs, policy, NOW).kept_steps == [30]  # no losses given


def test_best_step():
    from elastic_ft.checkpoint.retention import best_step

    assert best_step({}) is None
    assert best_step({4: None, 8: float("nan")}) is None
    assert best_step({4: 2.0, 8: 1.0, 12: 1.0}) == 8
    assert best_step({4: True, 8: 3.0}) == 8  # a bool is not a loss


# A late evaluation: the checkpoint of its step was committed without it (a notice abandoned it), the resume
# redid it, and the checkpoints after carry it; keep_best reads it by the step it evaluated.

def _manifest(step, evaluated):
    from elastic_ft.checkpoint.manifest import BlobRef, Manifest

    return Manifest(run_id="r", step=step, cursor=step * 8, created=1.0, writer="w", config_hash="c",
                    blobs={"model": BlobRef(f"blobs/{step:012d}-n/model.safetensors", 1, "f" * 64)}, eval=evaluated)


def test_keep_best_finds_a_late_evaluation_by_the_step_it_evaluated():
    from elastic_ft.checkpoint.retention import eval_losses

    late = {"late": [{"step": 20, "loss": 0.5}]}
    read = [_manifest(10, {"step": 10, "loss": 2.0}), _manifest(20, {}),
            _manifest(30, {"step": 30, "loss": 1.5, **late}), _manifest(40, {"step": 40, "loss": 1.0, **late})]
    losses = eval_losses(read)
    assert losses == {10: 2.0, 20: 0.5, 30: 1.5, 40: 1.0}
    manifests, blobs = store_of([10, 20, 30, 40])
    assert plan_gc(manifests, blobs, RetentionPolicy(keep_last=1, keep_best=True), NOW, losses).kept_steps == [20, 40]
    # 30 deleted by retention: the newest checkpoint still carries the record, so 20 stays the best.
    assert eval_losses([read[1], read[3]]) == {20: 0.5, 40: 1.0}
    manifests, blobs = store_of([20, 40])
    policy = RetentionPolicy(keep_last=1, keep_best=True)
    assert plan_gc(manifests, blobs, policy, NOW, eval_losses([read[1], read[3]])).kept_steps == [20, 40]
    # A late record of a checkpoint retention deleted is no candidate: the best among those that exist.
    manifests, blobs = store_of([30, 40])
    assert plan_gc(manifests, blobs, policy, NOW, losses).kept_steps == [40]


def test_late_records_from_storage_are_read_defensively():
    from elastic_ft.checkpoint.retention import eval_losses

    odd = [{"step": "x", "loss": 1.0}, 7, {"step": True, "loss": 1.0}, {"step": -3, "loss": 1.0},
           {"step": 50, "loss": 0.1}, {"step": 20}, {"step": 30, "loss": "low"}]
    assert eval_losses([_manifest(50, {"step": 50, "loss": 3.0, "late": odd})]) == {50: 3.0, 20: None, 30: None}
    assert eval_losses([_manifest(50, {"late": {"step": 20, "loss": 1.0}})]) == {}  # not a list
    assert eval_losses([_manifest(50, {})]) == {}
