"""When to checkpoint (elastic_ft.train.cadence) and where to resume (elastic_ft.train.resume)."""

import json

from elastic_ft.checkpoint.manifest import BlobRef, Manifest
from elastic_ft.checkpoint.reader import Skipped
from elastic_ft.config import BatchConfig, CheckpointConfig
from elastic_ft.train.cadence import checkpoint_due
from elastic_ft.train.resume import plan_resume
from elastic_ft.train.scaling import plan_batch


def due(step, *, total=100, last=0, since=0.0, **cfg):
    return checkpoint_due(step=step, total_steps=total, last_step=last, seconds_since=since,
                          cfg=CheckpointConfig(**cfg))


def test_every_steps():
    hits = [s for s in range(1, 100) if due(s, every_steps=10, save_final=False)[0]]
    assert hits == list(range(10, 100, 10))
    assert due(20, every_steps=10)[1] == "every 10 steps"


def test_final_step():
    assert due(100, every_steps=None, save_final=True) == (True, "final step")
    assert due(100, every_steps=None, save_final=False)[0] is False
    assert due(100, every_steps=7, save_final=False)[0] is False


def test_never_twice_for_one_step():
    assert due(20, last=20, every_steps=10) == (False, "already saved at this step")
    assert due(100, last=100, save_final=True)[0] is False
    assert due(10, last=15, every_steps=10)[0] is False


def test_every_seconds():
    assert due(3, since=59.0, every_steps=None, every_seconds=60)[0] is False
    ok, why = due(3, since=61.0, every_steps=None, every_seconds=60)
    assert ok and "61s" in why
    assert due(3, since=10**6, every_steps=None, every_seconds=None)[0] is False


def _manifest(step, cursor, plan, config_hash="h1"):
    return Manifest(run_id="r", step=step, cursor=cursor, created=0.0, writer="w", config_hash=config_hash,
                    blobs={"model": BlobRef("blobs/x/model.safetensors", 1, "0" * 64)},
                    world={"size": plan.world}, batch_plan=json.loads(json.dumps(plan.to_dict())))


CFG = BatchConfig(global_batch=32, micro_batch=8)


def test_fresh_start():
    plan = plan_resume(None, [], plan=plan_batch(CFG, 1e-3, 2), config_hash="h1", total_steps=100)
    assert (plan.step, plan.cursor, plan.source, plan.rescale, plan.finished) == (0, 0, None, None, False)
    assert "no committed checkpoint" in plan.reason


def test_every_checkpoint_failed():
    skipped = [Skipped(20, "manifests/000000000020.json", "blob sha256 mismatch")]
    plan = plan_resume(None, skipped, plan=plan_batch(CFG, 1e-3, 2), config_hash="h1", total_steps=100)
    assert plan.step == 0 and "(1 retired to quarantine/)" in plan.reason
    assert plan.event()["skipped"][0]["reason"] == "blob sha256 mismatch"


def test_resume_same_world():
    p2 = plan_batch(CFG, 1e-3, 2)
    plan = plan_resume(_manifest(40, 1280, p2), [], plan=p2, config_hash="h1", total_steps=100)
    assert (plan.step, plan.cursor, plan.source) == (40, 1280, "manifests/000000000040.json")
    assert plan.rescale is None and not plan.config_changed and not plan.finished
    assert "step 40" in plan.reason and "world 2" in plan.reason


def test_resume_at_another_world_after_skips():
    skipped = [Skipped(60, "manifests/000000000060.json", "missing blob")]
    plan = plan_resume(_manifest(40, 1280, plan_batch(CFG, 1e-3, 2)), skipped, plan=plan_batch(CFG, 1e-3, 3),
                       config_hash="h2", total_steps=100)
    assert plan.step == 40 and plan.cursor == 1280
    assert plan.rescale["changed"]["world"] == {"old": 2, "new": 3}
    assert plan.config_changed and "changed" in plan.reason
    assert "retiring 1 newer unusable checkpoint(s)" in plan.reason


def test_resume_finished_run():
    p = plan_batch(CFG, 1e-3, 1)
    plan = plan_resume(_manifest(100, 3200, p), [], plan=p, config_hash="h1", total_steps=100)
    assert plan.finished and "already complete" in plan.reason
    # the same checkpoint with the run extended is not finished
    assert not plan_resume(_manifest(100, 3200, p), [], plan=p, config_hash="h1", total_steps=150).finished
