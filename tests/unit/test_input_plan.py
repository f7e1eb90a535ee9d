"""The input cache's records and when a cached file must be hashed again (elastic_ft.inputs.plan: pure)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_ft.inputs.plan import RECORD_VERSION, Record, digest_needed, records_from_json, records_to_json

STAMP = (1000, 1_700_000_000_000_000_000, 1_700_000_000_500_000_000, 42, 2049)


def test_an_untouched_file_needs_no_digest_and_any_moved_field_does():
    record = Record(etag="e", size=1000, sha256="d", chunk_size=1 << 20, stamp=STAMP)
    assert not digest_needed(record, list(STAMP))
    for i in range(len(STAMP)):
        moved = list(STAMP)
        moved[i] += 1
        assert digest_needed(record, moved), f"stamp field {i} moved but the copy was trusted"
    assert digest_needed(record, None)  # the file cannot be stat'ed
    assert digest_needed(Record(etag="e", size=1000, sha256="d"), list(STAMP))  # never stamped


def test_records_round_trip_through_json_with_their_stamp():
    records = {"model.safetensors": Record(etag="e", size=1000, sha256="d", chunk_size=1 << 20, stamp=STAMP)}
    doc = json.loads(json.dumps(records_to_json("s3://b/m/", records)))
    assert doc["version"] == RECORD_VERSION
    assert records_from_json(doc) == records


def test_a_first_format_record_is_read_as_a_plain_digest_without_stamp():
    doc = {"version": 1, "uri": "s3://b/k", "files": {"k": {"etag": "e", "size": 3, "sha256": "d"}}}
    assert records_from_json(doc) == {"k": Record(etag="e", size=3, sha256="d", chunk_size=0, stamp=None)}


def test_a_malformed_file_record_is_dropped_and_only_that_file_fetched_again():
    doc = {"version": RECORD_VERSION, "files": {
        "good": {"etag": "e", "size": 3, "sha256": "d", "chunk_size": 0, "stamp": None},
        "bad stamp": {"etag": "e", "size": 3, "sha256": "d", "chunk_size": 0, "stamp": ["x"]},
        "bad chunk": {"etag": "e", "size": 3, "sha256": "d", "chunk_size": -1},
    }}
    assert set(records_from_json(doc)) == {"good"}
    assert records_from_json({"version": 99, "files": doc["files"]}) == {}


def test_a_read_error_while_rehashing_a_cached_file_is_raised_not_taken_for_a_changed_file(tmp_path, monkeypatch):
    """A cached input whose stamp moved is hashed again; an EIO there must stop the start with the error,
    not count as "digest differs", which throws the verified copy away and fetches it again whole."""
    import errno

    from elastic_ft.checkpoint.digest import blob_sha256
    from elastic_ft.inputs import cache
    from elastic_ft.inputs.plan import Record

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x" * 100)
    record = Record(etag="e", size=100, sha256=blob_sha256(b"x" * 100, 0), chunk_size=0)
    assert cache._file_digest(str(path), record) == record.sha256
    assert cache._file_digest(str(path), dataclasses.replace(record, size=200)) is None  # shorter than recorded
    assert cache._file_digest(str(tmp_path / "gone"), record) is None

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cache, "file_blob_sha256", failing)
    with pytest.raises(OSError, match="Input/output error"):
        cache._file_digest(str(path), record)
