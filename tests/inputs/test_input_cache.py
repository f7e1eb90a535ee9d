"""The node-local input cache against real S3 servers: each object fetched once, reused while it is
current and intact, fetched again when it changed or the copy was damaged; bounds and bad keys refused."""

from __future__ import annotations

import logging
import os

import pytest

from elastic_ft.inputs.remote import RemoteInputs
from elastic_ft.inputs.resolve import InputError
from elastic_ft.inputs.uri import parse_prefix_uri
from tests.inputs.conftest import FAST

BODY = b'{"text": "hello"}\n{"text": "world"}\n'


def _stat(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns


def test_data_file_is_fetched_once_then_reused(remote):
    remote.put("data/train.jsonl", BODY)
    uri = remote.uri("data/train.jsonl")
    with remote.source() as first:
        path = first.file(uri, "data.files[0]")
        assert first.fetched[uri] == ["train.jsonl"]
    assert os.path.basename(path) == "train.jsonl"  # the extension still tells the format
    assert open(path, "rb").read() == BODY
    assert remote.gets("data/train.jsonl") == 1
    before = _stat(path)
    with remote.source() as again:  # a restarted worker: a new process, the same cache
        assert again.file(uri, "data.files[0]") == path
        assert again.fetched[uri] == []
    assert remote.gets("data/train.jsonl") == 1, "the second resolve downloaded the object again"
    assert _stat(path) == before


def test_changed_object_is_fetched_again(remote):
    remote.put("d.jsonl", BODY)
    uri = remote.uri("d.jsonl")
    with remote.source() as src:
        path = src.file(uri, "data.files[0]")
    remote.put("d.jsonl", BODY + b'{"text": "more"}\n')
    with remote.source() as src:
        assert src.file(uri, "data.files[0]") == path
        assert src.fetched[uri] == ["d.jsonl"]
    assert open(path, "rb").read() == BODY + b'{"text": "more"}\n'
    assert remote.gets("d.jsonl") == 2


@pytest.mark.parametrize("damage", ["same size", "truncated", "deleted"])
def test_damaged_local_copy_is_fetched_again(moto_remote, damage):
    remote = moto_remote
    remote.put("d.jsonl", BODY)
    uri = remote.uri("d.jsonl")
    with remote.source() as src:
        path = src.file(uri, "data.files[0]")
    if damage == "same size":
        with open(path, "r+b") as f:
            f.write(b"X")
    elif damage == "truncated":
        os.truncate(path, 5)
    else:
        os.remove(path)
    with remote.source() as src:
        src.file(uri, "data.files[0]")
        assert src.fetched[uri] == ["d.jsonl"]
    assert open(path, "rb").read() == BODY
    assert remote.gets("d.jsonl") == 2


def test_size_only_verification_reads_no_digest_but_still_sees_truncation(moto_remote):
    remote = moto_remote
    remote.put("d.jsonl", BODY)
    uri = remote.uri("d.jsonl")
    with remote.source(verify="size") as src:
        path = src.file(uri, "data.files[0]")
    os.truncate(path, 3)
    with remote.source(verify="size") as src:
        src.file(uri, "data.files[0]")
        assert src.fetched[uri] == ["d.jsonl"]
    assert open(path, "rb").read() == BODY


def test_missing_object_is_one_line_naming_field_and_uri(remote):
    uri = remote.uri("nope.jsonl")
    with remote.source() as src, pytest.raises(InputError) as err:
        src.file(uri, "data.files[1]")
    message = str(err.value)
    assert message == f"data.files[1]: {uri} does not exist"


def test_missing_bucket_is_one_line(moto_remote):
    with moto_remote.source() as src, pytest.raises(InputError) as err:
        src.file("s3://no-such-bucket-here/x.jsonl", "data.files[0]")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("data.files[0]: ") and "no-such-bucket-here" in str(err.value)


def test_transient_errors_are_retried_and_logged(moto_remote, caplog):
    remote = moto_remote
    remote.put("d.jsonl", BODY)
    remote.proxy.add("slowdown", method="GET", path="d.jsonl", times=2)
    with caplog.at_level(logging.WARNING), remote.source() as src:
        path = src.file(remote.uri("d.jsonl"), "data.files[0]")
    assert open(path, "rb").read() == BODY
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 2


def test_retries_run_out_in_one_error_naming_the_uri_and_count(moto_remote):
    remote = moto_remote
    remote.put("d.jsonl", BODY)
    remote.proxy.add("slowdown", method="GET", path="d.jsonl", times=100)
    with remote.source() as src, pytest.raises(InputError) as err:
        src.file(remote.uri("d.jsonl"), "data.files[0]")
    message = str(err.value)
    assert "\n" not in message and remote.uri("d.jsonl") in message and "after 3 attempts" in message
    assert not os.listdir(os.path.join(remote.cache_dir, next(d for d in os.listdir(remote.cache_dir)
                                                             if os.path.isdir(os.path.join(remote.cache_dir, d)))))


def test_object_over_the_size_bound_is_refused_before_download(moto_remote):
    remote = moto_remote
    remote.put("big.jsonl", BODY)
    with remote.source(max_file_bytes=10) as src, pytest.raises(InputError) as err:
        src.file(remote.uri("big.jsonl"), "data.files[0]")
    assert "inputs.max_file_bytes (10)" in str(err.value)
    assert remote.gets("big.jsonl") == 0


def test_prefix_bounds_refuse_too_many_or_too_large(moto_remote):
    remote = moto_remote
    for name in ("a", "b", "c"):
        remote.put(f"m/{name}", b"0123456789")
    with remote.source(max_model_files=2) as src, pytest.raises(InputError) as err:
        src.directory(remote.uri("m/"), "model.name_or_path")
    assert "inputs.max_model_files (2)" in str(err.value) and str(err.value).startswith("model.name_or_path: ")
    with remote.source(max_model_bytes=25) as src, pytest.raises(InputError) as err:
        src.directory(remote.uri("m/"), "model.name_or_path")
    assert "inputs.max_model_bytes (25)" in str(err.value)
    assert remote.gets("m/") == 0


def test_listing_reads_every_page(moto_remote):
    remote = moto_remote
    names = [f"shard-{i}.bin" for i in range(5)]
    for name in names:
        remote.put(f"m/{name}", name.encode())
    remote.put("m/", b"")  # a console's folder marker: skipped
    lister = RemoteInputs(FAST, page_size=2)
    try:
        listed = lister.list(parse_prefix_uri(remote.uri("m/")), max_files=100)
    finally:
        lister.close()
    assert sorted(o.rel for o in listed) == names
    assert sum(1 for s in remote.proxy.seen if s.method == "GET" and "list-type=2" in s.path) == 3


def test_the_model_directory_follows_the_prefix(moto_remote):
    remote = moto_remote
    names = ["config.json", "model.safetensors", "sub/extra.txt"]
    for name in names:
        remote.put(f"m/{name}", name.encode())
    with remote.source() as src:
        path = src.directory(remote.uri("m/"), "model.name_or_path")
        assert sorted(src.fetched[remote.uri("m/")]) == names
    assert open(os.path.join(path, "sub", "extra.txt"), "rb").read() == b"sub/extra.txt"
    remote.delete("m/sub/extra.txt")
    with remote.source() as src:
        assert src.directory(remote.uri("m"), "model.name_or_path") == path  # the trailing '/' may be left out
        assert src.fetched[remote.uri("m")] == []
    assert not os.path.exists(os.path.join(path, "sub", "extra.txt")), "a file gone from the prefix stayed"
    assert remote.gets("m/") == 3


@pytest.mark.parametrize("bad_key", ["m/a//b", "m/./b", "m/x/../../../escape"])
def test_listed_key_that_would_leave_its_directory_is_refused(moto_remote, bad_key):
    remote = moto_remote
    remote.put("m/config.json", b"{}")
    remote.endpoint.client().put_object(Bucket=remote.endpoint.bucket, Key=remote.prefix + bad_key, Body=b"x")
    listed = [o["Key"] for o in remote.endpoint.client().list_objects_v2(
        Bucket=remote.endpoint.bucket, Prefix=remote.prefix)["Contents"]]
    if remote.prefix + bad_key not in listed:
        pytest.skip(f"the server stored {bad_key!r} under another key: {listed}")
    with remote.source() as src, pytest.raises(InputError) as err:
        src.directory(remote.uri("m/"), "model.name_or_path")
    assert "cannot be cached" in str(err.value)
    assert not os.path.exists(os.path.join(remote.cache_dir, "escape"))
    assert remote.gets("m/") == 0
