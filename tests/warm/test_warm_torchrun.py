"""Warm starts under torchrun itself: workers killed and restarted twice train exactly as cold ones do."""

from __future__ import annotations

import pytest

from elastic_ft.runevents.events import read_events
from tests.conftest import DEFAULT_SPEC, explain, process_env, torchrun

pytestmark = [pytest.mark.torchrun, pytest.mark.slow]

FAULTS = "kill:rank=1,step=3,restart=0;kill:rank=0,step=5,restart=1"


def run(tmp_path, warm: str) -> list[dict]:
    root = tmp_path / f"warm-{warm}"
    proc = torchrun(2, ["--spec", DEFAULT_SPEC, "--run_id", "w", "--checkpoint_uri", f"file://{root}/runs",
                        "steps=7", "checkpoint.every_steps=2", "logging.ledger=true"], max_restarts=2,
                    env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", ELASTIC_FT_WARM_START=warm,
                                    ELASTIC_FT_FAULTS=FAULTS))
    assert proc.returncode == 0, explain(proc)
    return list(read_events(str(root / "runs" / "w" / "logs" / "events.jsonl")))


def test_workers_killed_twice_restart_warm_and_train_as_cold_ones_do(tmp_path):
    warm, cold = run(tmp_path, "1"), run(tmp_path, "0")
    starts = {name: [e for e in log if e["event"] == "start"] for name, log in (("warm", warm), ("cold", cold))}
    assert [s["restart"] for s in starts["warm"]] == [0, 1, 2] == [s["restart"] for s in starts["cold"]]
    assert all(s["warm"] for s in starts["warm"]) and not any(s["warm"] for s in starts["cold"])
    # torchrun's worker pid is the launcher: the start counts from it, never from the later fork.
    assert all(s["process_start"] <= s["ts"] for s in starts["warm"])

    def trained(log):
        return [(e["step"], round(e["loss"], 6)) for e in log if e["event"] == "step"]

    def samples(log):
        return sorted((e["step"], str(e["samples"])) for e in log if e["event"] == "ledger")

    # The same steps, losses and samples, restarts included: the forks start from no state of the warm
    # process (RNG, environment, arguments all the launcher's).
    assert len(trained(warm)) >= 7  # every step at least once (steps 3-4 and 5 again after the kills)
    assert trained(warm) == trained(cold)
    assert samples(warm) == samples(cold)
