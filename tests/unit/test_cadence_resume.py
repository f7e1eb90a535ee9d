"""When to checkpoint (elastic_ft.train.cadence) and where to resume (elastic_ft.train.resume)."""

import json

from elastic_ft.checkpoint.manifest import BlobRef, Manifest
from elastic_ft.checkpoint.reader import Skipped
from elastic_ft.config import BatchConfig, CheckpointConfig
from elastic_ft.train.cadence import checkpoint_due
from elastic_ft.train.resume import incompatible_spec, plan_resume, shape_conflicts, shape_mismatches
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


# --------------------------------------------------------------------------- spec compatibility


def _spec_doc(**changes):
    from elastic_ft.config import load_spec
    from tests.conftest import DEFAULT_SPEC

    d = load_spec(DEFAULT_SPEC).to_dict()
    for dotted, value in changes.items():
        section, _, field = dotted.partition(".")
        if field:
            d[section][field] = value
        else:
            d[section] = value
    return d


def test_fields_that_do_not_shape_tensors_may_change():
    saved = _spec_doc()
    assert shape_conflicts(saved, _spec_doc(**{"optimizer.lr": 1.0, "lora.alpha": 64, "lora.dropout": 0.5})) == []
    assert shape_conflicts(saved, _spec_doc(steps=10_000)) == []
    assert incompatible_spec(saved, saved, step=4, run_id="r") is None
    assert incompatible_spec(None, saved, step=4, run_id="r") is None  # no spec recorded: not judged here


def test_lora_rank_and_targets_are_named():
    saved = _spec_doc(**{"lora.r": 8, "lora.target_modules": ["q_proj", "v_proj"]})
    assert shape_conflicts(saved, _spec_doc(**{"lora.r": 8, "lora.target_modules": ["v_proj", "q_proj"]})) == []
    now = _spec_doc(**{"lora.r": 16, "lora.target_modules": ["q_proj"]})
    assert shape_conflicts(saved, now) == [
        "lora.r is 8 in the checkpoint but 16 now",
        "lora.target_modules is ['q_proj', 'v_proj'] in the checkpoint but ['q_proj'] now",
    ]
    msg = incompatible_spec(saved, now, step=6, run_id="r1")
    assert "\n" not in msg and "step 6" in msg and "'r1'" in msg and "lora.r" in msg and "--run_id" in msg


def test_model_shape_and_full_fine_tune_are_named():
    saved = _spec_doc()
    config = dict(saved["model"]["config"] or {}, hidden_size=4096)
    assert shape_conflicts(saved, _spec_doc(**{"model.config": config})) == [
        f"model.config.hidden_size is {saved['model']['config'].get('hidden_size')!r} in the checkpoint but 4096 now"
    ]
    assert shape_conflicts(saved, _spec_doc(lora=None)) == ["lora: the checkpoint is LoRA, this spec a full fine-tune"]


def test_a_moved_model_directory_is_not_a_conflict_but_other_shapes_are_named():
    assert shape_conflicts(_spec_doc(**{"model.name_or_path": "/a/m"}), _spec_doc(**{"model.name_or_path": "/b/m"})) == []
    saved = {"l.lora_A.weight": (8, 64), "l.lora_B.weight": (64, 8), "gone": (1,)}
    now = {"l.lora_A.weight": (8, 128), "l.lora_B.weight": (64, 8), "new": (1,)}
    assert shape_mismatches(saved, now) == ["l.lora_A.weight is [8, 64] in the checkpoint but [8, 128] now"]
    assert shape_mismatches(saved, saved) == []


def test_dora_and_modules_to_save_are_named_and_an_older_checkpoint_without_them_still_loads():
    saved = _spec_doc()
    assert shape_conflicts(saved, _spec_doc(**{"lora.use_dora": True, "lora.modules_to_save": ["lm_head"]})) == [
        "lora.use_dora is False in the checkpoint but True now",
        "lora.modules_to_save is unset in the checkpoint but ['lm_head'] now",
    ]
    older = _spec_doc()
    for added in ("use_dora", "use_rslora", "modules_to_save", "init_lora_weights"):
        older["lora"].pop(added)
    assert shape_conflicts(older, _spec_doc()) == []
