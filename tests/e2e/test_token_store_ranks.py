"""The token store built by the ranks of real torchrun worlds (gloo): each rank tokenizes its share and the
leader concatenates the parts, so the files are byte-identical to a 1-process build whether 2 or 3 ranks
built them, also with packing (whose rows are decided from all samples' lengths, across the shares'
boundaries); a rank killed while building leaves no store in use and the next world finishes it; a store
error, or an unusable node cache, on one rank stops every rank with one line naming it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.config import DataConfig
from elastic_ft.train import data as data_mod
from elastic_ft.train.faults import ENV as FAULTS_ENV
from elastic_ft.train.model import byte_tokenizer
from elastic_ft.train.token_store import FILES
from tests.conftest import explain, process_env

pytestmark = [pytest.mark.torchrun, pytest.mark.slow]

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
SCRIPT = os.path.join(os.path.dirname(__file__), "token_store_ranks.py")


def write_data(tmp_path) -> str:
    rng = np.random.default_rng(7)
    path = tmp_path / "d.jsonl"
    # 301 records: the shares are uneven, and packed rows take samples of several shares.
    path.write_text("".join(json.dumps({"q": " ".join(rng.choice(WORDS, rng.integers(1, 15))),
                                        "a": " " + " ".join(rng.choice(WORDS, rng.integers(1, 10)))}) + "\n"
                            for _ in range(301)))
    return str(path)


def torchrun(ranks: int, run_dir, cache, configs, *extra: str, timeout: int = 300, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "--monitor-interval", "0.2", *extra, SCRIPT, str(run_dir), *(json.dumps(dataclasses.asdict(c)) for c in configs)]
    # A store per attempt: with torchrun's shared one, a restarted rank may read the gloo address of the rank
    # it replaces (tests/conftest.py's torchrun does the same).
    env = process_env(ELASTIC_FT_INPUT_CACHE=str(cache), PYTHONPATH=os.getcwd(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                      **env)
    return subprocess.run(cmd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def reported(proc) -> list[list[str]]:
    return [line.split() for line in proc.stdout.splitlines() if line.startswith("identity ")]


def one_process_store(tmp_path, monkeypatch, cfg):
    """The store of ``cfg`` built by one process: (identity, {file: bytes})."""
    cache = tmp_path / "cache-1"
    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(cache))
    _, built = data_mod.load_with_report(cfg, byte_tokenizer(), store=LocalStore(str(tmp_path / "runs-1" / "r")),
                                         run_id="r")
    return built.identity, {name: (cache / "tokens" / built.identity / name).read_bytes() for name in FILES}


def committed_keys(run_dir) -> list[str]:
    return sorted(k.key for k in LocalStore(str(run_dir)).list(""))


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_build_the_same_bytes_as_one(tmp_path, monkeypatch, ranks):
    path = write_data(tmp_path)
    configs = [DataConfig(files=[path], prompt_field="q", response_field="a", max_length=40),
               DataConfig(files=[path], text_field="q", packing=True, max_length=24)]
    cache = tmp_path / f"cache-{ranks}"
    proc = torchrun(ranks, tmp_path / f"runs-{ranks}" / "r", cache, configs)
    assert proc.returncode == 0, explain(proc)
    lines = reported(proc)
    assert [r[3] for r in lines] == ["True", "True"], proc.stdout  # the world built both

    for cfg, line in zip(configs, lines):
        ident, files = one_process_store(tmp_path, monkeypatch, cfg)
        assert ident == line[1]
        for name in FILES:
            assert (cache / "tokens" / ident / name).read_bytes() == files[name], (cfg.packing, name)
    # No part of the build is left in the run's store: only the committed store and its manifest.
    left = committed_keys(tmp_path / f"runs-{ranks}" / "r")
    assert left and all("/parts/" not in k for k in left), left


def test_a_rank_killed_while_building_leaves_no_store_in_use_and_the_next_world_finishes_it(tmp_path, monkeypatch):
    path = write_data(tmp_path)
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=40)
    run_dir, cache = tmp_path / "runs-2" / "r", tmp_path / "cache-2"
    # World 0: rank 1 dies with its share tokenized, before its part is uploaded. World 1: rank 1's part is
    # uploaded and the leader has uploaded the assembled store's blobs when it dies, before the manifest.
    # World 2 builds it again, whole.
    faults = "kill_build:rank=1,restart=0,point=share; kill_build:rank=0,restart=1,point=commit"
    proc = torchrun(2, run_dir, cache, [cfg], "--max-restarts", "2", **{FAULTS_ENV: faults})
    assert proc.returncode == 0, explain(proc)
    # No rank of the lost worlds returned a store: the only one used is world 2's, which built it.
    lines = reported(proc)
    assert [(r[3], r[7]) for r in lines] == [("True", "2")], proc.stdout
    ident, files = one_process_store(tmp_path, monkeypatch, cfg)
    assert lines[0][1] == ident
    for name in FILES:
        assert (cache / "tokens" / ident / name).read_bytes() == files[name], name
    # The lost worlds' parts and blobs are gone from the run's store: only what its one manifest names.
    keys = committed_keys(run_dir)
    manifest = json.loads((run_dir / f"tokens/{ident}/manifests/000000000000.json").read_text())
    named = {f"tokens/{ident}/{ref['key']}" for ref in manifest["blobs"].values()}
    assert set(keys) == named | {f"tokens/{ident}/manifests/000000000000.json"}, keys
    # ... and the killed ranks' work directories from this node's cache.
    assert not [n for n in os.listdir(cache / "tokens") if n.startswith(".build-")], os.listdir(cache / "tokens")


@pytest.mark.parametrize("fault, error", [
    # Without the fix rank 0 waits in the build's gather for a rank that gave up, until the collective
    # timeout (120 s in the script): the settle of rank 1 gives up after 20 s and torchrun stops rank 0
    # before it printed anything.
    ("FAIL_PART_UPLOADS_ON_RANK", "StoreUnavailable: injected: the store refuses"),
    # Without the fix rank 1 fails on its node's disk outside the exchanged steps: rank 0 waits in the build's
    # gather for it and learns only that gloo's connection closed (or waits out the collective timeout),
    # never which rank failed or why.
    ("UNUSABLE_NODE_CACHE_ON_RANK", "NotADirectoryError"),
], ids=["store error", "unusable node cache"])
def test_a_failure_on_one_rank_stops_every_rank_with_one_line(tmp_path, fault, error):
    path = write_data(tmp_path)
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=40)
    run_dir = tmp_path / "runs-2" / "r"
    (tmp_path / "cache").mkdir()
    proc = torchrun(2, run_dir, tmp_path / "cache", [cfg], timeout=100, **{fault: "1"})
    assert proc.returncode != 0, explain(proc)
    errors = sorted(line for line in proc.stdout.splitlines() if " error: " in line)
    assert len(errors) == 2, explain(proc)
    assert errors[0].startswith("rank 0 error: RunAborted: the token store's build (tokenizing the shares) failed "
                                f"on rank 1: {error}"), errors
    assert errors[1].startswith(f"rank 1 error: {error}"), errors
    assert not [k for k in committed_keys(run_dir) if "/manifests/" in k]  # nothing committed
