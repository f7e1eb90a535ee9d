"""The main job with its checkpoints on S3 (SeaweedFS): a worker SIGKILLed mid-run,
torchrun restarts it, the job resumes from S3 and finishes with every sample
consumed exactly once; then every ``elastic-ft ckpt`` command and ``export``
work on the ``s3://`` URI as they do on ``file://``."""

from __future__ import annotations

import os

import pytest
import torch

from elastic_ft.checkpoint.reader import list_manifests, load_newest
from elastic_ft.checkpoint.s3 import S3Store
from elastic_ft.config import load_spec
from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.ledger import check_exactly_once, replay
from elastic_ft.train.cursor import take
from tests.checkpoint.s3_servers import aws_env
from tests.conftest import DEFAULT_SPEC, cli, explain, process_env, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

STEPS = 24
RUN = "s3main"


def s3_process_env(endpoint, tmp, **extra) -> dict:
    """Child-process environment that reaches ``endpoint`` the way a user's would: standard AWS variables."""
    return aws_env(process_env(**extra), endpoint, tmp)


@pytest.fixture(scope="module")
def s3_job(s3_servers, tmp_path_factory):
    endpoint = s3_servers.get("seaweedfs")
    tmp = str(tmp_path_factory.mktemp("s3main"))
    base = f"s3://{endpoint.bucket}/jobs/{os.path.basename(tmp)}"
    logs = os.path.join(tmp, "logs")
    args = ["--spec", DEFAULT_SPEC, "--run_id", RUN, "--checkpoint_uri", base, "--log_dir", logs,
            f"steps={STEPS}", "checkpoint.every_steps=4", "logging.ledger=true", "logging.every_steps=4",
            # The restart reads its checkpoint back from S3 (what this job proves): the step the node kept in
            # memory would be newer (tests/chaos/test_kept_state_resume.py proves that path).
            "checkpoint.keep_step_in_memory=false"]
    env = s3_process_env(endpoint, tmp, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                         ELASTIC_FT_FAULTS="kill:rank=1,step=14,restart=0")
    proc = torchrun(2, args, max_restarts=1, env=env)
    assert proc.returncode == 0, explain(proc)
    return endpoint, f"{base}/{RUN}", read_events(os.path.join(logs, "events.jsonl")), s3_process_env(endpoint, tmp)


def open_like_the_cli(uri: str, env: dict, monkeypatch) -> S3Store:
    """The run's store, opened from the same standard AWS variables the CLI gets."""
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    for name, value in env.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    return S3Store.from_uri(uri)


def listed_objects(store: S3Store) -> list[str]:
    return [o.key for o in store.list()]


def test_killed_job_resumes_from_s3_and_completes_exactly_once(s3_job, monkeypatch):
    _, uri, events, env = s3_job
    starts = [e for e in events if e["event"] == "start"]
    assert [s["restart"] for s in starts] == [0, 1], "torchrun did not restart the workers once"
    restart_at = events.index(starts[1])
    committed_before = [e["step"] for e in events[:restart_at] if e["event"] == "checkpoint_committed"]
    assert committed_before and all(e["key"].startswith(uri) for e in events if e["event"] == "checkpoint_committed")
    resume = [e for e in events if e["event"] == "resume_plan"][-1]
    assert resume["step"] == max(committed_before) >= 8
    assert resume["source"].endswith(f"{resume['step']:012d}.json")
    history = replay(events)
    assert sorted(history) == list(range(STEPS))
    assert check_exactly_once(history, 1024) == []
    # In the cursor's order: the restart went on with the samples where the committed cursor stood.
    spec = load_spec(DEFAULT_SPEC)
    consumed = [p for step in sorted(history) for p in history[step]]
    assert consumed == take(0, STEPS * spec.batch.global_batch, 1024, spec.seed)
    assert events[-1]["event"] == "end" and events[-1]["step"] == STEPS
    # What is on the server is what the job says it committed.
    store = open_like_the_cli(uri, env, monkeypatch)
    try:
        loaded, skipped = load_newest(store, RUN)
        assert skipped == [] and loaded.manifest.step == STEPS
        assert len(list_manifests(store)) == 3  # keep_last: 3
    finally:
        store.close()


def test_ckpt_commands_work_on_s3_uri(s3_job, monkeypatch):
    _, uri, _, env = s3_job
    store = open_like_the_cli(uri, env, monkeypatch)
    before = listed_objects(store)
    assert any(k.startswith("manifests/") for k in before) and any(k.startswith("blobs/") for k in before)
    ls = cli("ckpt", "ls", uri, env=env)
    assert ls.returncode == 0, explain(ls)
    assert [line.split()[0] for line in ls.stdout.splitlines()[1:]] == ["16", "20", "24"], ls.stdout
    verify = cli("ckpt", "verify", uri, env=env)
    assert verify.returncode == 0, explain(verify)
    assert f"step {STEPS} OK" in verify.stdout
    dry = cli("ckpt", "gc", uri, "--dry-run", "--keep-last", "1", env=env)
    assert dry.returncode == 0, explain(dry)
    assert "keep checkpoints at steps [24]" in dry.stdout
    for step in (16, 20):
        assert f"would delete manifests/{step:012d}.json" in dry.stdout, dry.stdout
    assert listed_objects(store) == before, "the dry run deleted something"
    store.close()


def test_export_from_s3_loads_with_peft(s3_job, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, uri, _, env = s3_job
    out = tmp_path / "adapter"
    proc = cli("export", uri, "--out", str(out), env=env)
    assert proc.returncode == 0, explain(proc)
    assert f"exported step {STEPS} as a PEFT adapter" in proc.stdout
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(out / "base")), str(out))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b), "the exported adapter is untrained"
    assert all(torch.isfinite(p).all() for p in lora_b)
