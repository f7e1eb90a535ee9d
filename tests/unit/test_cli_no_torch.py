"""The read-only commands (``ckpt ls``, ``ckpt verify``, ``ckpt gc --dry-run``, ``status``, ``events``,
``goodput``) answer without importing torch or the model libraries: on a committed run, not only on
``--help`` or an empty location, where they stop before reading anything.

torch's import is ~3.5 s of CPU: the suite calls these commands tens of times, and a user on a laptop
feels every one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("torch", "transformers", "peft", "safetensors.torch", "numpy", "bitsandbytes")

# The CLI as ``python -m elastic_ft.cli`` runs it; at exit (sys.exit included), the heavy modules loaded.
WRAPPER = (
    "import atexit, runpy, sys\n"
    f"atexit.register(lambda: print('heavy:', sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr))\n"
    "sys.argv = ['elastic-ft', *sys.argv[1:]]\n"
    "runpy.run_module('elastic_ft.cli', run_name='__main__', alter_sys=True)\n"
)


@pytest.fixture(scope="module")
def run_uri(tmp_path_factory) -> str:
    """A run with two committed checkpoints (written by the checkpoint writer) and its shipped events."""
    import torch

    from elastic_ft.checkpoint.local import LocalStore
    from elastic_ft.checkpoint.writer import CheckpointWriter, snapshot
    from elastic_ft.runevents.shipper import Shipper

    root = tmp_path_factory.mktemp("run") / "r"
    store = LocalStore(str(root))
    writer = CheckpointWriter(store, "r")
    shipper = Shipper(store, 1, writer="w")
    shipper.write({"ts": 1.0, "event": "start", "run_id": "r", "attempt": 1, "world": 1})
    for step in (2, 4):
        shipper.write({"ts": 1.0 + step, "event": "step_done", "run_id": "r", "attempt": 1, "step": step,
                       "seconds": 0.5})
        writer.commit(snapshot(step, step * 4, {"model": {"w": torch.full((3,), float(step)),
                                                          "b": torch.zeros(2, dtype=torch.bfloat16)}},
                               documents={"trainer": {"step": step}}, config_hash="h"))
    shipper.ship()
    return f"file://{root}"


@pytest.mark.subprocess
@pytest.mark.parametrize("argv, says", [
    (["ckpt", "ls", "URI"], "manifests/000000000004.json"),
    (["ckpt", "verify", "URI"], "checkpoint at step 4 OK: 2 blobs"),  # hashed, and each header checked
    (["ckpt", "gc", "URI", "--dry-run"], "keep checkpoints at steps [2, 4]"),
    (["status", "URI"], "last checkpoint: step 4"),
    (["events", "URI"], '"step": 4'),
    (["goodput", "URI"], "goodput "),
], ids=["ckpt-ls", "ckpt-verify", "ckpt-gc-dry-run", "status", "events", "goodput"])
def test_read_only_commands_do_not_import_torch(run_uri, argv, says):
    out = subprocess.run([sys.executable, "-c", WRAPPER, *(run_uri if a == "URI" else a for a in argv)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    assert says in out.stdout, out.stdout  # it did its work (read the run), not stop early
    assert out.stderr.splitlines()[-1] == "heavy: []", out.stderr
