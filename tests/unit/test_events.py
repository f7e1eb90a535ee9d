"""Where a run's events live (elastic_ft.runevents.events.events_dir) and how goodput finds them again."""

import logging
import os

import pytest

from elastic_ft.checkpoint.store import UnsupportedURI
from elastic_ft.runevents.events import EventLog, events_dir, joined_line, local_runs_root, read_events
from elastic_ft.runevents.goodput import find_events

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


def test_the_console_gets_a_short_line_and_the_file_the_json(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    events = EventLog(str(path), run_id="r1", attempt=2)
    with caplog.at_level(logging.INFO, logger="elastic_ft.runevents.events"):
        events.emit("start", world=2, total_steps=100, batch_plan={"world": 2}, spec="tiny")
        events.emit("resume_plan", step=40, skipped=[], reason="resuming from step 40 (cursor 320) saved at world 3")
        events.emit("rescale", step=40, reason="constant_global", changed={"world": {"old": 3, "new": 2}})
        events.emit("checkpoint_committed", step=60, key="file:///x", bytes=214059, seconds=0.05, reason="every_steps")
        events.emit("end", step=100, final_loss=5.264629905934453, seconds=12.3)
        events.emit("ledger", quiet=True, step=1, samples=[[[0, 1]]])  # per rank, (epoch, index) pairs
    events.close()
    assert [r.getMessage() for r in caplog.records] == [
        "start: attempt 2 of run r1, world 2, 100 steps",
        "resume: resuming from step 40 (cursor 320) saved at world 3",
        "rescale at step 40: world 3 -> 2 (constant_global)",
        "checkpoint at step 60 committed (every_steps): 214,059 bytes in 0.05 s",
        "end: step 100, final_loss 5.2646, seconds 12.3",
    ]
    assert not any("{" in r.getMessage() for r in caplog.records)
    assert [e["event"] for e in read_events(str(path))] == [
        "start", "resume_plan", "rescale", "checkpoint_committed", "end", "ledger"]


def test_a_node_without_the_leader_shows_how_the_run_goes_on_and_other_ranks_stay_at_debug(caplog):
    head, other = EventLog(None, node_head=True, run_id="r1", attempt=1), EventLog(None, run_id="r1", attempt=1)
    with caplog.at_level(logging.INFO, logger="elastic_ft.runevents.events"):
        for events in (head, other):
            events.emit("start", world=3, total_steps=60)  # the node's own "joined" line says it (Trainer.run)
            events.emit("resume_plan", step=4, reason="resuming from step 4 (cursor 128) saved at world 3")
            events.emit("checkpoint_committed", step=8, bytes=1, seconds=0.1, reason="every_steps")
            events.emit("end", step=60, final_loss=0.9, seconds=3.0)
    assert [r.getMessage() for r in caplog.records] == [
        "resume: resuming from step 4 (cursor 128) saved at world 3", "end: step 60, final_loss 0.9, seconds 3"]


def test_the_joined_line_names_the_block_of_ranks_the_node_holds():
    assert joined_line("r1", 1, 2, 3, 1) == "joined run r1 (attempt 1): this node holds ranks 1-2 of world 3"
    assert joined_line("r1", 2, 1, 3, 4) == "joined run r1 (attempt 4): this node holds rank 2 of world 3"
