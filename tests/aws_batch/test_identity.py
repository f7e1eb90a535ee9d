"""A worker on AWS Batch names its node (array index, attempt) in its start event."""

from __future__ import annotations

import logging
import os

import pytest

from elastic_ft.runevents.node_identity import batch_node
from elastic_ft.runevents.events import read_events
from tests.e2e.conftest import train


@pytest.mark.parametrize(
    "env, node",
    [
        ({"AWS_BATCH_JOB_ARRAY_INDEX": "3", "AWS_BATCH_JOB_ATTEMPT": "2"}, "array index 3, attempt 2"),
        ({"AWS_BATCH_JOB_ATTEMPT": "1"}, "attempt 1"),  # a plain (one-node) container job
        ({"AWS_BATCH_JOB_ARRAY_INDEX": "9999"}, "array index 9999"),
        ({}, None),
    ],
)
def test_batch_node(env, node):
    assert batch_node(env) == node


@pytest.mark.parametrize("value", ["3; rm -rf /", "-1", "1e3", "", "٣", "1234567"])
def test_values_that_are_not_small_numbers_are_ignored_with_one_warning(value, caplog):
    with caplog.at_level(logging.WARNING, logger="elastic_ft.runevents.node_identity"):
        assert batch_node({"AWS_BATCH_JOB_ARRAY_INDEX": value, "AWS_BATCH_JOB_ATTEMPT": "2"}) == "attempt 2"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "AWS_BATCH_JOB_ARRAY_INDEX" in warnings[0]


def test_start_event_names_the_batch_node(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_BATCH_JOB_ARRAY_INDEX", "5")
    monkeypatch.setenv("AWS_BATCH_JOB_ATTEMPT", "3")
    assert train(str(tmp_path), "node", "steps=1") == 0
    starts = [e for e in read_events(os.path.join(tmp_path, "node", "logs", "events.jsonl")) if e["event"] == "start"]
    assert starts and starts[0]["node"] == "array index 5, attempt 3"


def test_start_event_has_no_node_off_batch(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_BATCH_JOB_ARRAY_INDEX", raising=False)
    monkeypatch.delenv("AWS_BATCH_JOB_ATTEMPT", raising=False)
    assert train(str(tmp_path), "plain", "steps=1") == 0
    starts = [e for e in read_events(os.path.join(tmp_path, "plain", "logs", "events.jsonl")) if e["event"] == "start"]
    assert starts and "node" not in starts[0]
