"""The benchmarks that drive the trainer's internals still run, at a size of seconds.

``bench/step_overhead.py`` builds a ``Trainer`` and reaches into it (its model, its DDP wrapper, its step);
a rename in the trainer broke it once with nothing in the suite to notice. Here it runs a few steps of
each loop, with ``--hf`` (``transformers.Trainer`` on the same model), and ``bench/chunked_loss.py`` at a
small vocabulary; each must finish and print its ratios. The figures mean nothing at this size.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.conftest import REPO, explain, run

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # two spawned ranks, three loops


def bench(name: str, *args: str):
    return run([sys.executable, os.path.join(REPO, "bench", name), *args], timeout=300)


def test_step_overhead_runs_against_the_plain_loop_and_transformers_trainer():
    done = bench("step_overhead.py", "--steps", "8", "--warmup", "1", "--block", "2", "--hf")
    assert done.returncode == 0, explain(done)
    assert re.search(r"ratio trainer/baseline = \d+\.\d+", done.stdout), explain(done)
    assert re.search(r"ratio trainer/transformers\.Trainer = \d+\.\d+", done.stdout), explain(done)


def test_chunked_loss_bench_runs():
    done = bench("chunked_loss.py", "--vocab", "2048", "--hidden", "32", "--tokens", "128", "--chunk", "32",
                 "--repeats", "1")
    assert done.returncode == 0, explain(done)
    assert "chunked" in done.stdout, explain(done)


def test_data_bench_runs_its_store_measures():
    """``bench/data.py``'s children (a 2-rank torchrun build, restarts from the store) at 200 samples."""
    done = bench("data.py", "--samples", "200", "--max-length", "128", "--store-only", "--repeats", "1")
    assert done.returncode == 0, explain(done)
    assert re.search(r"restart vs demo corpus \(fastest of 1\): [+-]\d+\.\d+ s", done.stdout), explain(done)
    assert "build, 2 ranks" in done.stdout, explain(done)


@pytest.mark.s3server
def test_model_fetch_bench_runs_each_way():
    """``bench/model_fetch.py`` (SeaweedFS; the single stream, ranged GETs into the file, the store's read, a
    restart) at 4 MB: each way finishes and prints its ratio."""
    done = bench("model_fetch.py", "--mb", "4", "--repeats", "1", "--part-mb", "1")
    assert done.returncode == 0, explain(done)
    for way in ("single stream (before)", "parallel ranged GETs", "checkpoint store's read"):
        assert re.search(re.escape(way) + r" .* ratio +\d+\.\d+", done.stdout), (way, explain(done))
    assert "now (the stamp matches)" in done.stdout, explain(done)
