"""Large inputs come down in parallel ranged GETs (the checkpoint store's read path, into the file),
each range pinned to the planned ETag and retried alone; a node that holds a verified copy starts
without a GET of it and without reading it again, until the file on disk is touched.

Real S3 servers (moto, SeaweedFS) behind the fault proxy, which records every request and its Range.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading

import pytest

from elastic_ft.checkpoint.digest import CHUNK_SIZE, blob_sha256
from elastic_ft.checkpoint.s3.errors import ObjectChanged
from elastic_ft.inputs.remote import RemoteInputs
from elastic_ft.inputs.uri import parse_object_uri
from tests.inputs.conftest import FAST
from tests.waiting import wait_until

pytestmark = pytest.mark.s3server

MiB = 1 << 20
PART = 1 * MiB
# Small parts so that a few MiB is a multi-part object; three ranges in flight at most.
RANGED = dataclasses.replace(FAST, download_part_size=PART, max_concurrency=3)
SIZE = 5 * MiB + 12345  # six ranges, the last one short


def _body(size: int = SIZE) -> bytes:
    return os.urandom(size)


def _gets(remote, key: str):
    """The GETs of ``key`` (not listings) that reached the proxy, in arrival order."""
    path = f"/{remote.endpoint.bucket}/{remote.prefix}{key}"
    return [s for s in remote.proxy.seen if s.method == "GET" and s.path.split("?")[0] == path]


def _span(header: str | None) -> tuple[int, int]:
    match = re.fullmatch(r"bytes=(\d+)-(\d+)", header or "")
    assert match, f"a GET without a byte range: {header!r}"
    return int(match.group(1)), int(match.group(2))


def _expected_ranges(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + PART, size) - 1) for a in range(0, size, PART)]


def _rchar() -> int:
    """Bytes this process has read through read() calls so far (files and sockets)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_large_object_is_fetched_in_parallel_ranges_byte_identical(remote):
    body = _body()
    remote.put("m/model.safetensors", body)
    uri = remote.uri("m/model.safetensors")
    with remote.source(RANGED) as src:
        path = src.file(uri, "data.files[0]")
        assert src.fetched[uri] == ["model.safetensors"]
    assert open(path, "rb").read() == body
    spans = sorted(_span(s.range) for s in _gets(remote, "m/model.safetensors"))
    assert spans == _expected_ranges(len(body)), "not one ranged GET per part, covering the object once"
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".eft-part-" in n], "a temp file was left"


def test_small_object_keeps_one_get(remote):
    remote.put("tok/tokenizer.json", b'{"version": "1.0"}')
    with remote.source(RANGED) as src:
        path = src.file(remote.uri("tok/tokenizer.json"), "model.tokenizer")
    assert open(path, "rb").read() == b'{"version": "1.0"}'
    assert len(_gets(remote, "tok/tokenizer.json")) == 1


def test_zero_byte_object_is_cached_empty(moto_remote):
    remote = moto_remote
    remote.put("m/empty.txt", b"")
    with remote.source(RANGED) as src:
        path = src.directory(remote.uri("m/"), "model.name_or_path")
    assert os.path.getsize(os.path.join(path, "empty.txt")) == 0
    assert len(_gets(remote, "m/empty.txt")) == 1


@pytest.mark.parametrize("fault", ["truncate", "slowdown"])
def test_range_cut_short_or_refused_midway_is_retried_alone(remote, fault):
    body = _body()
    remote.put("big.bin", body)
    # The first two GETs of the object pass (a zero delay), the third is cut short or answered 503.
    remote.proxy.add("delay", method="GET", path=r"big\.bin$", times=2, seconds=0)
    remote.proxy.add(fault, method="GET", path=r"big\.bin$", times=1, keep=1000)
    with remote.source(RANGED) as src:
        path = src.file(remote.uri("big.bin"), "data.files[0]")
    assert open(path, "rb").read() == body
    gets = _gets(remote, "big.bin")
    hit = [s for s in gets if s.fault == fault]
    assert len(hit) == 1, f"the {fault} fault never applied: {gets}"
    again = [s for s in gets if s.range == hit[0].range]
    assert [s.fault for s in again] == [fault, None], "the failed range was not retried (once)"
    assert len(gets) == len(_expected_ranges(len(body))) + 1, "more than the failed range was fetched again"
    assert sorted({_span(s.range) for s in gets}) == _expected_ranges(len(body))


def test_object_overwritten_between_plan_and_fetch_raises_the_etag_error(remote, tmp_path):
    remote.put("w.bin", _body())
    loc = parse_object_uri(remote.uri("w.bin"))
    fetcher = RemoteInputs(RANGED)
    try:
        planned = fetcher.head(loc, "w.bin")
        remote.put("w.bin", _body())  # same size, another version
        with pytest.raises(ObjectChanged):
            fetcher.download(loc.bucket, planned, str(tmp_path / "w.part"))
    finally:
        fetcher.close()
    assert [s.fault for s in _gets(remote, "w.bin")] == [None], "an overwritten object was fetched on"


def test_object_overwritten_midway_raises_the_etag_error_not_a_mixed_file(remote, tmp_path):
    first = _body()
    remote.put("w.bin", first)
    loc = parse_object_uri(remote.uri("w.bin"))
    # The first range passes; the others wait at the proxy while the object is overwritten.
    remote.proxy.add("delay", method="GET", path=r"w\.bin$", times=1, seconds=0)
    remote.proxy.add("delay", method="GET", path=r"w\.bin$", times=100, seconds=2.0)
    fetcher = RemoteInputs(RANGED)
    outcome: list[BaseException | None] = []
    dest = tmp_path / "w.part"
    try:
        planned = fetcher.head(loc, "w.bin")

        def fetch() -> None:
            try:
                fetcher.download(loc.bucket, planned, str(dest))
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 (handed to the test thread)
                outcome.append(exc)

        worker = threading.Thread(target=fetch)
        worker.start()
        wait_until(lambda: len(_gets(remote, "w.bin")) >= 2, timeout=30,
                   what="the second range of w.bin at the proxy")
        remote.put("w.bin", _body())  # straight to the server, while the later ranges wait
        worker.join(timeout=60)
    finally:
        fetcher.close()
    assert outcome and isinstance(outcome[0], ObjectChanged), f"expected ObjectChanged, got {outcome}"
    assert len(_gets(remote, "w.bin")) > 1


def test_second_fetch_on_the_node_neither_gets_nor_rereads_the_file(remote):
    body = _body(8 * MiB)
    remote.put("m/model.safetensors", body)
    remote.put("m/config.json", b"{}")
    uri = remote.uri("m/")
    with remote.source(RANGED) as src:
        path = src.directory(uri, "model.name_or_path")
    gets = len(_gets(remote, "m/model.safetensors"))
    before = _rchar()
    with remote.source(RANGED) as again:  # a retried child on the same host: a new source, the same cache
        assert again.directory(uri, "model.name_or_path") == path
        assert again.fetched[uri] == []
    read = _rchar() - before
    assert len(_gets(remote, "m/model.safetensors")) == gets, "the verified copy was downloaded again"
    assert read < len(body) // 4, f"the restart read {read} bytes: the untouched copy was hashed again"
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == body


def test_file_altered_in_place_with_its_mtime_restored_is_fetched_again(remote):
    body = _body()
    remote.put("m/model.safetensors", body)
    uri = remote.uri("m/")
    with remote.source(RANGED) as src:
        path = os.path.join(src.directory(uri, "model.name_or_path"), "model.safetensors")
    st = os.stat(path)
    with open(path, "r+b") as f:  # one byte flipped mid-file: same size
        f.seek(3 * MiB + 7)
        f.write(bytes([body[3 * MiB + 7] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.path.getsize(path) == len(body)
    gets = len(_gets(remote, "m/model.safetensors"))
    with remote.source(RANGED) as again:
        again.directory(uri, "model.name_or_path")
        assert again.fetched[uri] == ["model.safetensors"]
    assert open(path, "rb").read() == body
    assert len(_gets(remote, "m/model.safetensors")) > gets


def test_record_holds_the_digest_taken_while_the_ranges_landed(moto_remote):
    remote = moto_remote
    body = _body()
    remote.put("d.bin", body)
    with remote.source(RANGED) as src:
        path = src.file(remote.uri("d.bin"), "data.files[0]")
    import json

    doc = json.load(open(os.path.dirname(path) + ".json"))
    record = doc["files"]["d.bin"]
    assert record["sha256"] == blob_sha256(body, CHUNK_SIZE) and record["chunk_size"] == CHUNK_SIZE
    st = os.stat(path)
    assert record["stamp"] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def test_copy_recorded_by_the_first_cache_format_is_hashed_once_then_trusted(moto_remote):
    import hashlib
    import json

    remote = moto_remote
    body = _body()
    remote.put("d.bin", body)
    uri = remote.uri("d.bin")
    with remote.source(RANGED) as src:
        path = src.file(uri, "data.files[0]")
    record_path = os.path.dirname(path) + ".json"
    # What the cache wrote before stamps: a plain sha256, record version 1.
    json.dump({"version": 1, "uri": uri, "files": {"d.bin": {
        "etag": json.load(open(record_path))["files"]["d.bin"]["etag"], "size": len(body),
        "sha256": hashlib.sha256(body).hexdigest()}}}, open(record_path, "w"))
    gets = len(_gets(remote, "d.bin"))
    with remote.source(RANGED) as src:
        src.file(uri, "data.files[0]")
        assert src.fetched[uri] == [], "a copy the old format recorded was downloaded again"
    assert len(_gets(remote, "d.bin")) == gets
    before = _rchar()
    with remote.source(RANGED) as src:
        src.file(uri, "data.files[0]")
    assert _rchar() - before < len(body) // 4, "the copy was hashed again after it was stamped"
