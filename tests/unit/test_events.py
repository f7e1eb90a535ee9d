"""Where a run's events live (elastic_ft.events.events_dir) and how goodput finds them again."""

import os

import pytest

from elastic_ft.checkpoint.store import UnsupportedURI
from elastic_ft.events import events_dir, local_runs_root
from elastic_ft.goodput import find_events

XDG = {"XDG_CACHE_HOME": "/xdg"}


def test_a_filesystem_run_keeps_its_events_in_its_own_directory():
    assert events_dir("file:///data/ckpt", "r1") == "/data/ckpt/r1/logs"
    assert events_dir("file:///data/ckpt/", "r1") == "/data/ckpt/r1/logs"
    assert events_dir("/data/ckpt", "r1") == "/data/ckpt/r1/logs"
    assert events_dir("file://./runs", "tiny-lora") == "./runs/tiny-lora/logs"  # the default: as before


def test_an_s3_run_keeps_its_events_in_a_local_directory_named_after_it_whatever_the_cwd():
    assert local_runs_root(XDG) == "/xdg/elastic_ft/runs"
    assert events_dir("s3://bucket/prefix", "r1", environ=XDG) == "/xdg/elastic_ft/runs/r1/logs"
    home = os.path.expanduser("~")
    assert events_dir("s3://bucket/prefix", "r1", environ={}) == f"{home}/.cache/elastic_ft/runs/r1/logs"


def test_the_spec_logging_dir_overrides_and_a_bad_uri_is_refused():
    assert events_dir("s3://bucket/p", "r1", template="logs/{run_id}/x") == "logs/r1/x"
    with pytest.raises(UnsupportedURI):
        events_dir("file://host/x", "r1")


def test_goodput_finds_the_events_from_the_run_uri_or_its_id(tmp_path, monkeypatch):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    on_disk = tmp_path / "ckpt" / "r1" / "logs" / "events.jsonl"
    on_s3 = tmp_path / "xdg" / "elastic_ft" / "runs" / "r2" / "logs" / "events.jsonl"
    for f in (on_disk, on_s3):
        f.parent.mkdir(parents=True)
        f.write_text("")
    assert find_events(f"file://{tmp_path}/ckpt/r1", env) == str(on_disk)
    assert find_events(f"file://{tmp_path}/ckpt/r1/", env) == str(on_disk)
    assert find_events(str(tmp_path / "ckpt" / "r1"), env) == str(on_disk)
    assert find_events("s3://bucket/prefix/r2", env) == str(on_s3)
    monkeypatch.chdir(tmp_path)
    assert find_events("r2", env) == str(on_s3)
    with pytest.raises(FileNotFoundError, match="no events.jsonl at 'r3'"):
        find_events("r3", env)
