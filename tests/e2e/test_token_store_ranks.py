"""The token store built by the ranks of a real 2-process torchrun world (gloo): each rank tokenizes its
share and the leader concatenates the parts, so the files are byte-identical to a 1-process build, also
with packing (whose rows are decided from all samples' lengths, across the shares' boundary)."""

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
from elastic_ft.train.model import byte_tokenizer
from elastic_ft.train.token_store import FILES
from tests.conftest import explain, process_env

pytestmark = [pytest.mark.torchrun, pytest.mark.slow]

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def test_two_ranks_build_the_same_bytes_as_one(tmp_path, monkeypatch):
    rng = np.random.default_rng(7)
    path = tmp_path / "d.jsonl"
    # 301 records: the 2 shares are uneven, and packed rows take samples of both shares.
    path.write_text("".join(json.dumps({"q": " ".join(rng.choice(WORDS, rng.integers(1, 15))),
                                        "a": " " + " ".join(rng.choice(WORDS, rng.integers(1, 10)))}) + "\n"
                            for _ in range(301)))
    configs = [DataConfig(files=[str(path)], prompt_field="q", response_field="a", max_length=40),
               DataConfig(files=[str(path)], text_field="q", packing=True, max_length=24)]
    two_cache = tmp_path / "cache-2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(os.path.dirname(__file__), "token_store_ranks.py"), str(tmp_path / "runs-2" / "r"),
           *(json.dumps(dataclasses.asdict(c)) for c in configs)]
    proc = subprocess.run(cmd, env=process_env(ELASTIC_FT_INPUT_CACHE=str(two_cache), PYTHONPATH=os.getcwd()),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc)
    reported = [line.split() for line in proc.stdout.splitlines() if line.startswith("identity ")]
    assert [r[3] for r in reported] == ["True", "True"], proc.stdout  # the world built both

    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(tmp_path / "cache-1"))
    for cfg, line in zip(configs, reported):
        one, built = data_mod.load_with_report(cfg, byte_tokenizer(), store=LocalStore(str(tmp_path / "runs-1" / "r")),
                                               run_id="r")
        assert built.built and built.identity == line[1]
        for name in FILES:
            ours = (tmp_path / "cache-1" / "tokens" / built.identity / name).read_bytes()
            theirs = (two_cache / "tokens" / built.identity / name).read_bytes()
            assert ours == theirs, (cfg.packing, name)
    # No part of the build is left in the run's store: only the committed store and its manifest.
    left = [k.key for k in LocalStore(str(tmp_path / "runs-2" / "r")).list("")]
    assert left and all("/parts/" not in k for k in left), left
