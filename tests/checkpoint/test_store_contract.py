"""The object store contract, run against every backend: filesystem, moto and SeaweedFS.

One suite, every backend (STYLE.md 11): whatever the manifest writer and the
loader rely on is asserted here the same way for each store.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time

import pytest

from elastic_ft.checkpoint.digest import blob_sha256
from elastic_ft.checkpoint.segments import Segments
from elastic_ft.checkpoint.store import BlobMismatch, ObjectExists, ObjectNotFound, StoreError, StoreUnavailable

MiB = 1 << 20


def test_store_put_get_roundtrip(backend):
    store = backend.store
    store.put("blobs/1-a/model.safetensors", b"weights")
    store.put("blobs/1-a/empty.json", b"")
    store.put("blobs/1-a/view.bin", memoryview(bytearray(b"from a view")))
    assert store.get("blobs/1-a/model.safetensors") == b"weights"
    assert store.get("blobs/1-a/empty.json") == b""
    assert store.get("blobs/1-a/view.bin") == b"from a view"


def test_store_overwrite_replaces_whole_object(backend):
    store = backend.store
    store.put("state.json", b"x" * 1000)
    store.put("state.json", b"short")
    assert store.get("state.json") == b"short"


def test_store_if_absent_refuses_existing_key(backend):
    store = backend.store
    store.put("manifest-1.json", b"first", if_absent=True)
    with pytest.raises(ObjectExists, match="manifest-1.json"):
        store.put("manifest-1.json", b"second", if_absent=True)
    assert store.get("manifest-1.json") == b"first"


@pytest.mark.parametrize("round_", range(3))
def test_store_if_absent_race_has_exactly_one_winner(backend, round_):
    if backend.name == "moto":
        # moto 5.2 checks If-None-Match and then writes, without a lock
        # (moto/s3/responses.py put_object): racing writers can both win there.
        # Sequential 412s are still checked on moto by the other tests.
        pytest.skip("moto's If-None-Match is check-then-write, not atomic; the race runs on file and SeaweedFS")
    store = backend.store
    writers = 8
    key = f"manifest-{round_}.json"
    barrier = threading.Barrier(writers)
    results: dict[int, str] = {}

    def write(i: int) -> None:
        barrier.wait()
        try:
            store.put(key, f"writer {i}".encode(), if_absent=True)
            results[i] = "won"
        except ObjectExists:
            results[i] = "lost"
        except Exception as exc:  # recorded, so the assertion below shows it
            results[i] = repr(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results.values()) == ["lost"] * (writers - 1) + ["won"], results
    (winner,) = [i for i, r in results.items() if r == "won"]
    assert store.get(key) == f"writer {winner}".encode()


def test_store_get_missing_raises_not_found_naming_key(backend):
    with pytest.raises(ObjectNotFound, match="no/such/key"):
        backend.store.get("no/such/key")
    with pytest.raises(ObjectNotFound, match="missing.bin"):
        backend.store.get_verified("missing.bin", size=1, sha256="0" * 64)


def test_store_list_by_prefix_sorted(backend):
    store = backend.store
    keys = ["b/2", "a/1", "a/10", "a/2", "ab", "c"]
    for k in keys:
        store.put(k, k.encode() * 3)
    listed = store.list("a")
    assert [o.key for o in listed] == ["a/1", "a/10", "a/2", "ab"]
    assert [o.size for o in listed] == [len(k) * 3 for k in ["a/1", "a/10", "a/2", "ab"]]
    assert all(o.mtime > 0 for o in listed)
    assert [o.key for o in store.list("a/")] == ["a/1", "a/10", "a/2"]
    assert [o.key for o in store.list()] == sorted(keys)
    assert store.list("zzz") == []


def test_store_delete_is_idempotent(backend):
    store = backend.store
    store.put("blobs/9-x/a", b"a")
    store.delete("blobs/9-x/a")
    store.delete("blobs/9-x/a")
    store.delete("never/was/here")
    with pytest.raises(ObjectNotFound):
        store.get("blobs/9-x/a")
    assert store.list("blobs/") == []


def test_store_rejects_bad_keys(backend):
    for bad in ("", "a//b", "../escape", "a/./b"):
        with pytest.raises(StoreError, match="invalid object key"):
            backend.store.put(bad, b"x")


def test_store_large_blob_multipart_and_ranged_verified(backend):
    store = backend.store
    # 12 MiB + 3 bytes: three multipart parts (5, 5, 2) on S3 and 13 ranged GETs.
    data = os.urandom(12 * MiB + 3)
    digest = hashlib.sha256(data).hexdigest()
    store.put("blobs/5-n/model.safetensors", data)
    assert store.get_verified("blobs/5-n/model.safetensors", size=len(data), sha256=digest) == data
    for chunk in (MiB, 768 * 1024, 5 * MiB):  # S3: ranges of 1 MiB, or grown to whole chunks
        got = store.get_verified("blobs/5-n/model.safetensors", size=len(data), sha256=blob_sha256(data, chunk),
                                 chunk_size=chunk)
        assert got == data, chunk
    assert store.get("blobs/5-n/model.safetensors") == data
    (info,) = store.list("blobs/5-n/")
    assert info.size == len(data)
    if backend.endpoint is not None:
        # A multipart object's ETag is "<md5 of part md5s>-<part count>".
        assert backend.s3_head("blobs/5-n/model.safetensors")["ETag"].strip('"').endswith("-3")


@pytest.mark.parametrize("size", [100, 12 * MiB + 3])
def test_store_put_of_segments_stores_their_concatenation(backend, size):
    # How the writer uploads tensors without serialising them first: on S3 the
    # large case's multipart parts each span several buffers.
    data = os.urandom(size)
    cuts = sorted({0, size, *(int(size * f) for f in (0.1, 0.3, 0.31, 0.7))})
    segments = Segments([data[a:b] for a, b in zip(cuts, cuts[1:])])
    backend.store.put("blobs/6-s/model.safetensors", segments)
    assert backend.store.get("blobs/6-s/model.safetensors") == data


def test_store_large_blob_if_absent(backend):
    store = backend.store
    data = os.urandom(6 * MiB)
    store.put("big-manifest", data, if_absent=True)
    with pytest.raises(ObjectExists, match="big-manifest"):
        store.put("big-manifest", os.urandom(6 * MiB), if_absent=True)
    assert store.get("big-manifest") == data


@pytest.mark.parametrize("size", [10, 3 * MiB + 1])
@pytest.mark.parametrize("chunk", [0, MiB], ids=["plain", "chunked"])
def test_store_get_verified_mismatch_names_key(backend, size, chunk):
    store = backend.store
    data = os.urandom(size)
    store.put("blobs/3-z/opt.safetensors", data)
    good = blob_sha256(data, chunk)
    for other in (data[:-1] + bytes([data[-1] ^ 1]), bytes([data[0] ^ 1]) + data[1:]):  # the last or first byte
        with pytest.raises(BlobMismatch, match=r"blobs/3-z/opt\.safetensors.*sha256"):
            store.get_verified("blobs/3-z/opt.safetensors", size=size, sha256=blob_sha256(other, chunk), chunk_size=chunk)
    for claimed in (size + 1, size - 1, 3 * size):  # S3: ranges past the end, or a short last one
        with pytest.raises(BlobMismatch, match=r"blobs/3-z/opt\.safetensors.*bytes"):
            store.get_verified("blobs/3-z/opt.safetensors", size=claimed, sha256=good, chunk_size=chunk)
    assert store.get_verified("blobs/3-z/opt.safetensors", size=size, sha256=good, chunk_size=chunk) == data


@pytest.mark.parametrize("size", [10, 3 * MiB + 1])
@pytest.mark.parametrize("chunk", [0, MiB, 10**15], ids=["plain", "chunked", "huge-chunk"])
def test_store_get_verified_checks_a_claimed_size_before_allocating_it(backend, size, chunk):
    # A corrupt manifest claiming a petabyte: the store compares the claim with
    # the object's real size before allocating a buffer or a digest of that size,
    # and says which blob and both sizes (the old S3 store tried to map 10**15 bytes).
    data = os.urandom(size)
    backend.store.put("blobs/3-h/model.safetensors", data)
    started = time.monotonic()
    for claimed in (10**15, 2**62):
        with pytest.raises(BlobMismatch, match=rf"blobs/3-h/model\.safetensors.* has {size} bytes .*records {claimed}"):
            backend.store.get_verified("blobs/3-h/model.safetensors", size=claimed, sha256="0" * 64, chunk_size=chunk)
    # Not hashing or allocating the claimed 10**15 bytes (hours, or a MemoryError
    # above); the margin is for a busy machine, not a timing goal.
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_store_objects_get_the_mode_the_umask_implies(tmp_path, umask):
    # Objects are written to a temporary file (mode 0600) and renamed into place;
    # on a shared filesystem they must be as readable as any file the user creates.
    from elastic_ft.checkpoint.local import LocalStore

    store = LocalStore(str(tmp_path / "store"))
    old = os.umask(umask)
    try:
        store.put("blobs/1-m/model.safetensors", b"weights")
        store.put("manifest-1.json", b"{}", if_absent=True)
    finally:
        os.umask(old)
    for key in ("blobs/1-m/model.safetensors", "manifest-1.json"):
        mode = stat.S_IMODE(os.stat(tmp_path / "store" / key).st_mode)
        assert mode == 0o666 & ~umask, (key, oct(mode))


class TestLocalStoreCouldNotAnswer:
    """Filesystem errors other than a missing file are StoreUnavailable (the disk
    could not answer), never a raw OSError or a silent empty answer."""

    @pytest.fixture
    def store(self, tmp_path):
        from elastic_ft.checkpoint.local import LocalStore

        return LocalStore(str(tmp_path / "store"))

    def test_directory_where_a_blob_should_be(self, store):
        os.makedirs(os.path.join(store.root, "blobs", "1-d", "model.safetensors"))
        with pytest.raises(StoreUnavailable, match=r"get of \S*blobs/1-d/model\.safetensors failed: Is a directory"):
            store.get("blobs/1-d/model.safetensors")
        with pytest.raises(StoreUnavailable, match=r"blobs/1-d/model\.safetensors.*EISDIR"):
            store.get_verified("blobs/1-d/model.safetensors", size=7, sha256="0" * 64)

    def test_file_where_a_directory_should_be(self, store):
        store.put("blobs/1-f", b"a file, not the blob directory")
        with pytest.raises(StoreUnavailable, match=r"get of \S*blobs/1-f/model\.safetensors failed: Not a directory"):
            store.get("blobs/1-f/model.safetensors")
        with pytest.raises(StoreUnavailable, match=r"put of \S*blobs/1-f/model\.safetensors failed"):
            store.put("blobs/1-f/model.safetensors", b"x")

    def test_unreadable_object(self, store):
        # A symlink loop stands in for EIO/EACCES (tests may run as root, which
        # permissions do not stop): an OSError that is not "no such file".
        os.makedirs(os.path.join(store.root, "blobs", "1-l"))
        os.symlink("model.safetensors", os.path.join(store.root, "blobs", "1-l", "model.safetensors"))
        with pytest.raises(StoreUnavailable, match=r"get of \S*blobs/1-l/model\.safetensors failed: .*ELOOP"):
            store.get("blobs/1-l/model.safetensors")
        with pytest.raises(StoreUnavailable, match=r"list of \S*blobs/\* failed: .*ELOOP"):
            store.list("blobs/")

    def test_root_that_is_not_a_directory_is_not_an_empty_store(self, store):
        with open(store.root, "wb") as f:
            f.write(b"not a checkpoint directory")
        with pytest.raises(StoreUnavailable, match=r"list of \S*store/\* failed: Not a directory"):
            store.list()
