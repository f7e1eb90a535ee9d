"""The job spec's ``spot`` section: defaults, bounds and errors naming ``spot.<field>``."""

from __future__ import annotations

import os

import pytest

from elastic_ft.config import ConfigError, load_spec

SPEC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "specs",
                    "tiny-lora.yaml")


def test_defaults_watch_for_notices():
    spot = load_spec(SPEC).spot
    assert spot.enabled and spot.sigterm and spot.on_rebalance == "checkpoint"
    assert spot.poll_interval_s == 1.0 and spot.token_ttl_s == 21600 and not spot.train_until_deadline


def test_spot_settings_do_not_change_the_config_hash():
    # They say how to react to a reclaim, not what is trained: a resume must accept either.
    assert load_spec(SPEC, ["spot.enabled=false", "spot.poll_interval_s=5"]).hash() == load_spec(SPEC).hash()


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError) as info:
        load_spec(SPEC, ["spot.poll_interval_s=0", "spot.on_rebalance=leave", "spot.token_ttl_s=21601",
                         "spot.enabled=maybe", "spot.poll_interval=3"])
    problems = dict(info.value.problems)
    assert problems["spot.poll_interval_s"] == "must be in [0.1, 60.0], got 0.0"
    assert problems["spot.on_rebalance"] == "'leave' is not one of 'checkpoint', 'ignore'"
    assert problems["spot.token_ttl_s"] == "must be in [1, 21600], got 21601"
    assert problems["spot.enabled"] == "must be bool, got 'maybe'"
    assert "spot.poll_interval" in problems and "poll_interval_s" in problems["spot.poll_interval"]


def test_a_bad_imds_endpoint_stops_the_worker_with_one_line(monkeypatch, capsys, tmp_path):
    from elastic_ft import worker
    from elastic_ft.spot.imds import ENDPOINT_ENV

    monkeypatch.setenv(ENDPOINT_ENV, "169.254.169.254:80")
    code = worker.main(["--spec", SPEC, "--checkpoint_uri", f"file://{tmp_path}", "--log_dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == (f"elastic_ft: error: {ENDPOINT_ENV}='169.254.169.254:80' must look like http://host[:port] "
                       f"(default http://169.254.169.254): the scheme must be http or https")
    assert not (tmp_path / "tiny-lora").exists(), "nothing may be written before the endpoint is checked"
