"""Choosing the checkpoint to resume from (elastic_ft.checkpoint.choice): pure, over outcomes.

Only a proven corruption may retire a checkpoint; anything that merely could
not be read stops the choice with nothing retired."""

import errno

import pytest

from elastic_ft.checkpoint.choice import CORRUPT, FOREIGN, OK, UNAVAILABLE, Outcome, choose, classify, need_more
from elastic_ft.checkpoint.manifest import ManifestCorrupt, ManifestError, ManifestForeign
from elastic_ft.checkpoint.store import BlobMismatch, ObjectExists, ObjectNotFound, StoreError, StoreUnavailable


@pytest.mark.parametrize("exc, absent, kind", [
    (BlobMismatch("sha256 differs"), None, CORRUPT),
    (ManifestCorrupt("not valid JSON"), None, CORRUPT),
    (ManifestForeign("belongs to run 'b'"), None, FOREIGN),
    (ObjectNotFound("gone"), True, CORRUPT),  # a listing that succeeded confirms it
    (ObjectNotFound("gone"), False, UNAVAILABLE),  # a listing shows it, or could not be made
    (ObjectNotFound("gone"), None, UNAVAILABLE),
    (StoreUnavailable("503 SlowDown, retries ran out"), None, UNAVAILABLE),
    (StoreError("AccessDenied"), None, UNAVAILABLE),
    (ObjectExists("odd, but not a proof of corruption"), None, UNAVAILABLE),
    (OSError(errno.ENOMEM, "Cannot allocate memory"), None, UNAVAILABLE),
    (IsADirectoryError(errno.EISDIR, "Is a directory"), None, UNAVAILABLE),
    (MemoryError(), None, UNAVAILABLE),
    (KeyError("a bug"), None, None),
])
def test_classify(exc, absent, kind):
    assert classify(exc, blob_absent=absent) == kind


def test_every_manifest_error_is_corrupt_or_foreign():
    assert issubclass(ManifestCorrupt, ManifestError) and issubclass(ManifestForeign, ManifestError)


def o(step, kind, reason="why"):
    return Outcome(step, f"manifests/{step:012d}.json", reason, kind)


def test_newest_ok_is_loaded():
    c = choose([o(6, OK)])
    assert c.load == o(6, OK) and c.retire == () and c.stop is None


def test_corrupt_ones_are_retired_on_the_way_to_an_ok_one():
    c = choose([o(8, CORRUPT), o(6, CORRUPT), o(4, OK)])
    assert c.load.step == 4 and [r.step for r in c.retire] == [8, 6] and c.stop is None
    assert "step 4" in c.reason


@pytest.mark.parametrize("outcomes", [
    [o(6, UNAVAILABLE, "503 SlowDown")],
    [o(8, CORRUPT), o(6, UNAVAILABLE, "503 SlowDown")],  # the corrupt one waits: no rollback happens now
    [o(6, UNAVAILABLE, "503 SlowDown"), o(4, OK)],
])
def test_unavailable_stops_with_nothing_retired(outcomes):
    c = choose(outcomes)
    assert c.load is None and c.retire == () and c.stop.kind == UNAVAILABLE
    assert "step 6 could not be read" in c.reason and "nothing was retired" in c.reason and "503 SlowDown" in c.reason


def test_foreign_is_a_hard_stop():
    c = choose([o(8, CORRUPT), o(6, FOREIGN, "belongs to run 'other'"), o(4, OK)])
    assert c.load is None and c.retire == () and c.stop.kind == FOREIGN
    assert "not this run's" in c.reason and "'other'" in c.reason


def test_nothing_usable():
    assert choose([]) == choose([]) and choose([]).load is None and choose([]).stop is None
    c = choose([o(4, CORRUPT), o(2, CORRUPT)])
    assert c.load is None and c.stop is None and [r.step for r in c.retire] == [4, 2]


def test_need_more_reads_past_corrupt_ones_only():
    assert need_more([]) and need_more([o(8, CORRUPT)])
    assert not need_more([o(8, CORRUPT), o(6, OK)])
    assert not need_more([o(8, UNAVAILABLE)]) and not need_more([o(8, FOREIGN)])


def test_unknown_kind_is_a_bug():
    with pytest.raises(ValueError, match="'maybe'"):
        choose([o(1, "maybe")])


def test_a_blob_is_proven_absent_only_by_a_listing_that_does_not_show_it(tmp_path):
    from elastic_ft.checkpoint.reader import confirmed_absent
    from elastic_ft.checkpoint.local import LocalStore

    store = LocalStore(str(tmp_path / "run"))
    assert confirmed_absent(store, "blobs/000000000002-x/model.safetensors")[0] is True
    store.put("blobs/000000000002-x/model.safetensors", b"w")
    absent, note = confirmed_absent(store, "blobs/000000000002-x/model.safetensors")
    assert absent is False and "listing shows it" in note
