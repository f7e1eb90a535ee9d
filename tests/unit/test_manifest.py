"""Manifest parsing (elastic_ft.checkpoint.manifest): strict, and every error names the key."""

import json

import pytest

from elastic_ft.checkpoint.manifest import (
    FORMAT, MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH, BlobRef, Manifest, ManifestCorrupt, ManifestError, ManifestForeign,
    check_manifest_size, json_depth_exceeds, manifest_key, parse_manifest, step_of_key,
)

KEY = "manifests/000000000020.json"


def good(**changes) -> dict:
    m = Manifest(run_id="run-a", step=20, cursor=640, created=1.5, writer="tok", config_hash="abc",
                 blobs={"model": BlobRef("blobs/000000000020-x/model.safetensors", 10, "f" * 64, 1 << 20),
                        "trainer": BlobRef("blobs/000000000020-x/trainer.json", 5, "e" * 64)},
                 world={"size": 2}, batch_plan={"world": 2})
    d = json.loads(m.to_json())
    d.update(changes)
    return d


def parse(d, key=KEY, run_id="run-a"):
    return parse_manifest(json.dumps(d).encode(), key=key, expected_run_id=run_id)


def test_round_trip():
    m = parse(good())
    assert (m.run_id, m.step, m.cursor, m.format) == ("run-a", 20, 640, FORMAT)
    assert m.blobs["model"] == BlobRef("blobs/000000000020-x/model.safetensors", 10, "f" * 64, 1 << 20)
    assert m.blobs["trainer"].chunk_size == 0
    assert m.total_size == 15 and m.key == KEY and m.world == {"size": 2}
    assert parse_manifest(m.to_json(), key=KEY) == m


def test_keys():
    assert manifest_key(20) == KEY
    assert step_of_key(KEY) == 20
    assert step_of_key("manifests/20.json") is None
    assert step_of_key("manifests/000000000020.json.tmp") is None


def error(d=None, *, data=None, key=KEY, run_id="run-a") -> str:
    with pytest.raises(ManifestError) as info:
        parse_manifest(data if data is not None else json.dumps(d).encode(), key=key, expected_run_id=run_id)
    msg = str(info.value)
    assert repr(key) in msg
    return msg


def test_wrong_format_version():
    msg = error(good(format="elastic_ft.checkpoint/3"))
    assert "'elastic_ft.checkpoint/3'" in msg and FORMAT in msg
    assert "format None" in error({k: v for k, v in good().items() if k != "format"})


def test_a_format_1_manifest_is_an_unsupported_format_named_in_one_line():
    # Format 1 (whole-blob digests) is written by no elastic_ft since format 2.
    d = good(format="elastic_ft.checkpoint/1")
    for ref in d["blobs"].values():
        del ref["chunk_size"]  # format 1 had no such field
    msg = error(d)
    assert "'elastic_ft.checkpoint/1', an unsupported format" in msg and "'elastic_ft.checkpoint/2'" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("field,value", [("chunk_size", -1), ("chunk_size", "1MiB"), ("size", 1.5), ("size", None)])
def test_malformed_blob_size_or_chunk_size(field, value):
    d = good()
    d["blobs"]["model"][field] = value
    msg = error(d)
    assert "'model'" in msg and field in msg


def test_other_run():
    msg = error(good(run_id="run-b"))
    assert "'run-b'" in msg and "'run-a'" in msg
    assert parse(good(run_id="run-b"), run_id=None).run_id == "run-b"  # no expectation: accepted


@pytest.mark.parametrize("data", [b"{not json", b"\xff\xfe", b""])
def test_bad_json(data):
    assert "not valid JSON" in error(data=data)


def test_not_an_object():
    assert "not a JSON object" in error(data=b"[1, 2]")


@pytest.mark.parametrize("blob_key", ["manifests/000000000020.json", "../other-run/blobs/x", "blobs/../../x", "/etc/passwd"])
def test_blob_outside_blobs_prefix(blob_key):
    d = good()
    d["blobs"]["model"]["key"] = blob_key
    msg = error(d)
    assert "'model'" in msg and repr(blob_key) in msg and "outside this run" in msg


def test_step_key_mismatch():
    msg = error(good(step=30))
    assert "step 30" in msg and "does not match" in msg
    assert parse(good(step=30), key="some/other/name.json").step == 30  # not a manifest key: nothing to match


@pytest.mark.parametrize("field", ["step", "cursor", "blobs", "writer"])
def test_missing_field(field):
    d = good()
    del d[field]
    assert "missing or has a malformed field" in error(d)


def test_malformed_blob_ref():
    d = good()
    d["blobs"]["model"] = {"key": "blobs/x"}
    assert "malformed" in error(d)
    assert "malformed" in error(good(step="twenty"))


# --------------------------------------------------------------------------- corrupt or foreign


def test_torn_manifest_is_corrupt_not_foreign():
    torn = json.dumps(good()).encode()[:-40]
    with pytest.raises(ManifestCorrupt, match="not valid JSON.*torn or truncated") as info:
        parse_manifest(torn, key=KEY, expected_run_id="run-a")
    assert repr(KEY) in str(info.value)


def test_other_run_and_format_are_foreign():
    with pytest.raises(ManifestForeign, match="'run-b'"):
        parse(good(run_id="run-b"))
    with pytest.raises(ManifestForeign, match="'elastic_ft.checkpoint/3'"):
        parse(good(format="elastic_ft.checkpoint/3"))


def test_malformed_fields_are_corrupt():
    with pytest.raises(ManifestCorrupt):
        parse({k: v for k, v in good().items() if k != "cursor"})
    with pytest.raises(ManifestCorrupt):
        parse(good(step=21))
    with pytest.raises(ManifestCorrupt):
        parse([1, 2])


def test_deep_manifest_is_refused_before_parsing_naming_the_file():
    deep = b'{"format": "elastic_ft.checkpoint/2", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ManifestCorrupt, match=f"{KEY}.*deeper than {MAX_MANIFEST_DEPTH}"):
        parse_manifest(deep, key=KEY)
    # Brackets inside strings are text, not nesting.
    assert parse(good(writer="[" * 100 + '\\"{' * 50)).writer == "[" * 100 + '\\"{' * 50


def test_oversized_manifest_is_refused_naming_the_file():
    with pytest.raises(ManifestCorrupt, match=f"{KEY}.*more than the"):
        parse_manifest(b" " * (MAX_MANIFEST_BYTES + 1), key=KEY)
    with pytest.raises(ManifestCorrupt, match=f"{KEY}.*more than the"):
        check_manifest_size(MAX_MANIFEST_BYTES + 1, key=KEY)
    check_manifest_size(MAX_MANIFEST_BYTES, key=KEY)


def test_json_depth():
    assert not json_depth_exceeds(b'{"a": [1, {"b": "[[[["}]}', 3)
    assert json_depth_exceeds(b'{"a": [1, {"b": "[[[["}]}', 2)
    assert not json_depth_exceeds(b'"\\\\"', 0)


def test_retiring_an_oversized_manifest_does_not_read_it(tmp_path):
    """Its size could be anything (a 50 GB object under manifests/): only the size is kept."""
    from elastic_ft.checkpoint.manifest import MAX_MANIFEST_BYTES
    from elastic_ft.checkpoint.local import LocalStore
    from elastic_ft.checkpoint.writer import retire

    class Reads(LocalStore):
        read: list[str] = []

        def get(self, key):
            self.read.append(key)
            return super().get(key)

    store = Reads(str(tmp_path))
    key = manifest_key(7)
    path = tmp_path / key
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: no disk
    target = retire(store, key, "manifest too large")
    assert store.read == []
    record = json.loads(LocalStore(str(tmp_path)).get(target))
    assert record["manifest_size"] == MAX_MANIFEST_BYTES + 1 and record["reason"] == "manifest too large"
    assert not path.exists()
