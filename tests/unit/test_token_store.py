"""The token store (elastic_ft.train.token_build / token_store), in this process: the samples equal the old
path's token for token, its identity follows every input that changes tokens, a torn blob is never used,
a restart reads no data file, and a micro-batch is padded to its own longest sample."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.config import DataConfig, load_spec
from elastic_ft.train import data as data_mod
from elastic_ft.train.model import byte_tokenizer
from elastic_ft.train.token_store import IGNORE, PAD_MULTIPLE, token_dtype
from tests.conftest import DEFAULT_SPEC
from tests.unit.old_tokenize import old_tokenize

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A node cache of the test's own (the token store's node copies live under it)."""
    root = tmp_path / "node-cache"
    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(root))
    return root


def write_jsonl(path, rows, prefix=b""):
    path.write_bytes(prefix + b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    return str(path)


def varied_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"q": " ".join(rng.choice(WORDS, rng.integers(1, 12))), "a": " " + " ".join(rng.choice(WORDS, rng.integers(1, 9)))}
            for _ in range(n)]


def columns(rows, fields):
    return {f: [r[f] for r in rows] for f in fields}


def assert_same_samples(store, old):
    """Each stored sample is the old path's row without its padding: ids, labels and target count."""
    lengths = old["attention_mask"].sum(dim=1)
    assert store.header.samples == len(lengths)
    for i in range(store.header.samples):
        ids, trained = store.sample(i)
        k = int(lengths[i])
        assert len(ids) == k, i
        assert ids.astype(np.int64).tolist() == old["input_ids"][i, :k].tolist(), i
        labels = np.where(trained.astype(bool), ids.astype(np.int64), IGNORE)
        assert labels.tolist() == old["labels"][i, :k].tolist(), i
        assert (old["labels"][i, k:] == IGNORE).all()
    assert store.targets.tolist() == old["target_tokens"].tolist()


def test_demo_corpus_samples_equal_the_old_path_token_for_token(cache):
    spec = load_spec(DEFAULT_SPEC, [])
    tok = byte_tokenizer()
    store = data_mod.load(spec.data, tok)
    with open(spec.data.files[0]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) == 1024
    assert_same_samples(store, old_tokenize(columns(rows, ["prompt", "response"]), spec.data, tok))
    assert store.tokens.dtype == np.uint16  # 259 ids: the smallest unsigned type that holds them


@pytest.mark.parametrize("packing", [False, True], ids=["text", "packing"])
def test_text_and_packed_samples_equal_the_old_path(cache, tmp_path, packing):
    """Packing keeps every sample whole (cut at max_length like the unpacked path), never a block cut
    across samples as the old packing did: its samples are the unpacked path's, token for token."""
    rows = [{"body": " ".join(r.values())} for r in varied_rows(60)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = DataConfig(files=[path], text_field="body", max_length=48, packing=packing)
    tok = byte_tokenizer()
    store = data_mod.load(cfg, tok)
    assert_same_samples(store, old_tokenize(columns(rows, ["body"]), dataclasses.replace(cfg, packing=False), tok))
    if packing:  # packed rows of several samples each, every sample in exactly one
        assert 1 <= len(store) < store.header.samples
        assert sorted(store.row_samples.tolist()) == list(range(store.header.samples))


def test_json_lines_streamed_and_parquet_through_datasets_give_the_same_samples(cache, tmp_path):
    import datasets

    rows = [{"q": "héllo \u2603", "a": " wörld", "extra": 1}, {"q": "2+2=", "a": " 4"}, {"a": "x", "q": ""}]
    jsonl = tmp_path / "pr.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "\n\n".join(json.dumps(r) for r in rows).encode() + b"\n\n")
    parquet = str(tmp_path / "pr.parquet")
    datasets.Dataset.from_list([{"q": r["q"], "a": r["a"]} for r in rows]).to_parquet(parquet)
    tok = byte_tokenizer()
    ours = data_mod.load(DataConfig(files=[str(jsonl), str(jsonl)], prompt_field="q", response_field="a", max_length=16), tok)
    theirs = data_mod.load(DataConfig(files=[parquet, parquet], prompt_field="q", response_field="a", max_length=16), tok)
    assert len(ours) == 6
    for name in ("tokens", "trained", "offsets", "targets"):
        assert np.array_equal(getattr(ours, name), getattr(theirs, name)), name


def test_a_micro_batch_is_as_long_as_its_longest_sample_rounded_to_8(cache, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * n} for n in (3, 10, 20, 45)])
    cfg = DataConfig(files=[path], max_length=48)
    tok = byte_tokenizer()
    store = data_mod.load(cfg, tok)
    old = old_tokenize({"text": ["x" * n for n in (3, 10, 20, 45)]}, cfg, tok)
    # Lengths with BOS and EOS: 5, 12, 22, 47 tokens.
    for chunk, width in (([0], 8), ([0, 1], 16), ([1, 0, 2], 24), ([2, 3], 48)):
        batch = store.batch(chunk)
        assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (len(chunk), width) for k in batch}
        for key in ("input_ids", "labels", "attention_mask"):
            assert torch.equal(batch[key], old[key][chunk, :width]), key
        assert width % PAD_MULTIPLE == 0 or width == cfg.max_length
    # The step's computed tokens: each micro-batch's rows times its padded length.
    assert store.computed_tokens([[0, 1], [2, 3]]) == 2 * 16 + 2 * 48
    assert store.real_tokens([0, 1, 2, 3]) == 5 + 12 + 22 + 47


def test_identity_follows_the_data_the_tokenizer_and_max_length(cache, tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, varied_rows(20))
    cfg = DataConfig(files=[str(path)], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    _, first = data_mod.load_with_report(cfg, tok)
    _, again = data_mod.load_with_report(cfg, tok)
    assert first.built and not again.built and again.identity == first.identity
    identities = {first.identity}
    write_jsonl(path, varied_rows(20, seed=1))  # new contents
    _, changed = data_mod.load_with_report(cfg, tok)
    identities.add(changed.identity)
    other = byte_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<sep>"]})
    identities.add(data_mod.load_with_report(cfg, other)[1].identity)
    shorter = DataConfig(files=[str(path)], prompt_field="q", response_field="a", max_length=16)
    identities.add(data_mod.load_with_report(shorter, tok)[1].identity)
    assert len(identities) == 4


def _run_store(tmp_path):
    return LocalStore(str(tmp_path / "runs" / "r"))


def _flip_middle_byte(data: bytes) -> bytes:
    torn = bytearray(data)
    torn[len(torn) // 2] ^= 0xFF  # an altered byte: the same size, another digest
    return bytes(torn)


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]  # an upload cut short: another size than the manifest's


@pytest.mark.parametrize("tear", [_flip_middle_byte, _truncate], ids=["altered", "truncated"])
def test_a_torn_blob_is_refused_and_the_store_rebuilt(cache, tmp_path, caplog, tear):
    path = write_jsonl(tmp_path / "d.jsonl", varied_rows(40))
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    good, built = data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id="r")
    expected = np.array(good.tokens)
    run = tmp_path / "runs" / "r" / "tokens" / built.identity
    blob = next((run / "blobs").glob("*/tokens.bin/00000"))
    blob.write_bytes(tear(blob.read_bytes()))
    node_copy = cache / "tokens" / built.identity
    for name in os.listdir(node_copy):  # a node that never had it: it must fetch from the run's store
        os.remove(node_copy / name)
    os.rmdir(node_copy)
    store, again = data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id="r")
    assert again.built and again.identity == built.identity
    assert np.array_equal(np.array(store.tokens), expected)
    assert "is not used, and is built again" in caplog.text
    assert len(os.listdir(run / "quarantine")) == 1  # the torn store's manifest, kept for inspection
    # The rebuilt store's blobs are verified: a third start maps it without building.
    assert not data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id="r")[1].built


@pytest.mark.parametrize("vocab,dtype", [(1, "u1"), (256, "u1"), (257, "<u2"), (65_536, "<u2"), (65_537, "<u4"),
                                         (2**32, "<u4")])
def test_token_dtype_is_the_smallest_that_holds_every_id(vocab, dtype):
    got = token_dtype(vocab)
    assert got == np.dtype(dtype) and got.str[0] in "|<"  # little-endian on disk whatever the host
    assert int(np.array([vocab - 1]).astype(got)[0]) == vocab - 1  # the top id survives the narrowing


def test_token_dtype_refuses_a_vocabulary_beyond_32_bits():
    with pytest.raises(ValueError, match=r"a vocabulary of 4294967297 ids does not fit 32 bits"):
        token_dtype(2**32 + 1)


def _alter_flip_byte(copy) -> None:
    data = bytearray(copy.read_bytes())
    data[3] ^= 0xFF
    copy.write_bytes(bytes(data))


def _alter_in_place_mtime_kept(copy) -> None:
    st = os.stat(copy)
    with open(copy, "r+b") as f:  # in place: same inode, same size
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(copy).st_size, os.stat(copy).st_mtime_ns, os.stat(copy).st_ino) == \
        (st.st_size, st.st_mtime_ns, st.st_ino)


@pytest.mark.parametrize("alter", [_alter_flip_byte, _alter_in_place_mtime_kept], ids=["rewritten", "in place"])
def test_an_altered_node_copy_is_fetched_again_not_used(cache, tmp_path, alter):
    """The node copy is trusted by its files' stat stamp once verified. A rewritten file changes it; so does a
    write that keeps the size and puts the mtime back (a tool restoring timestamps, ``cp -p`` over it): it
    moves the kernel's ctime. Either way the copy is hashed again and fetched, never mapped as it is."""
    path = write_jsonl(tmp_path / "d.jsonl", varied_rows(40))
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    good, built = data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id="r")
    expected = np.array(good.tokens)
    alter(cache / "tokens" / built.identity / "tokens.bin")
    store, again = data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id="r")
    assert not again.built
    assert np.array_equal(np.array(store.tokens), expected)


def test_a_restart_reads_no_data_file(cache, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", varied_rows(40))
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    assert data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id="r")[1].built
    opened: list[str] = []
    watched = os.path.realpath(path)

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and \
                os.path.realpath(os.fsdecode(args[0])) == watched:
            opened.append(event)

    sys.addaudithook(hook)  # cannot be removed; it only appends to this test's list
    try:
        store, report = data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id="r")
        assert not report.built and len(store) == 40
        assert opened == []
    finally:
        watched = None


def test_a_steps_tokens_count_every_ranks_micro_batches(cache, tmp_path):
    from types import SimpleNamespace

    from elastic_ft.train.micro_batches import step_tokens

    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * n} for n in (3, 45, 10, 20)])
    store = data_mod.load(DataConfig(files=[path], max_length=48), byte_tokenizer())
    # Rank 0 is dealt samples 0, 1, 2 (5, 47, 12 tokens), rank 1 sample 3 (22). Grouped by length, rank 0's
    # micro-batches are [1, 2] (47, 12: 2 x 48) and [0] (8), not [0, 1] (2 x 48) and [2] (16) in dealt order.
    plan = SimpleNamespace(per_rank=(3, 1), micro_batch=2)
    assert step_tokens(store, [0, 1, 2, 3], plan) == {"real_tokens": 86, "computed_tokens": 2 * 48 + 8 + 24}


@pytest.mark.parametrize("kind", ["parquet", "text", "saved-dataset", "saved-dataset-dict"])
def test_other_input_formats_go_through_the_same_store(cache, tmp_path, kind):
    """parquet and text files, and a ``data.dataset`` that is a local directory written by ``save_to_disk``
    (no hub download: a Dataset, or a DatasetDict whose ``data.split`` is taken), give the samples their
    records are, token for token."""
    import datasets

    rows = varied_rows(30, seed=3)
    fields = dict(prompt_field="q", response_field="a", max_length=24)
    expected = columns(rows, ["q", "a"])
    if kind == "parquet":
        path = str(tmp_path / "d.parquet")
        datasets.Dataset.from_list(rows).to_parquet(path)
        cfg = DataConfig(files=[path], **fields)
    elif kind == "text":
        lines = [r["q"] + r["a"] for r in rows]
        path = tmp_path / "d.txt"
        path.write_text("".join(line + "\n" for line in lines))
        cfg = DataConfig(files=[str(path)], max_length=24)
        expected = {"text": lines}
    elif kind == "saved-dataset":
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
        cfg = DataConfig(dataset=str(tmp_path / "saved"), **fields)
    else:
        datasets.DatasetDict({"train": datasets.Dataset.from_list(varied_rows(5)),
                              "validation": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
        cfg = DataConfig(dataset=str(tmp_path / "saved"), split="validation", **fields)
    tok = byte_tokenizer()
    store, built = data_mod.load_with_report(cfg, tok)
    assert built.built
    assert_same_samples(store, old_tokenize(expected, cfg, tok))
    assert not data_mod.load_with_report(cfg, tok)[1].built  # the same input: the same store, not rebuilt


def test_a_saved_dataset_directory_names_its_store_by_its_contents(cache, tmp_path):
    import datasets

    saved = str(tmp_path / "saved")
    cfg = DataConfig(dataset=saved, prompt_field="q", response_field="a", max_length=24)
    tok = byte_tokenizer()
    datasets.Dataset.from_list(varied_rows(10, seed=1)).save_to_disk(saved)
    first = data_mod.load_with_report(cfg, tok)[1].identity
    datasets.Dataset.from_list(varied_rows(10, seed=2)).save_to_disk(saved + ".new")
    os.rename(saved, saved + ".old")
    os.rename(saved + ".new", saved)
    assert data_mod.load_with_report(cfg, tok)[1].identity != first
    missing = DataConfig(dataset=saved, split="test", prompt_field="q", response_field="a", max_length=24)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(varied_rows(3))}).save_to_disk(saved + ".dict")
    with pytest.raises(data_mod.DataError, match=r"^data.dataset .* has splits \['train'\]; set data.split"):
        data_mod.load(dataclasses.replace(missing, dataset=saved + ".dict"), tok)


def test_lost_builds_parts_go_only_with_a_commit_and_never_the_committed_blobs(cache, tmp_path, caplog):
    """What builds that never committed left under a store's identity (parts, blobs no manifest names) is
    deleted by the build that commits; a store that cannot list (a transient fault) costs a warning, not
    the build, and deletes nothing; the committed store's blobs always stay."""
    from elastic_ft.checkpoint.errors import StoreUnavailable

    path = write_jsonl(tmp_path / "d.jsonl", varied_rows(40))
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    ident = data_mod.load_with_report(cfg, tok, store=LocalStore(str(tmp_path / "elsewhere")), run_id="r")[1].identity
    lost = [f"tokens/{ident}/parts/0123456789ab/00001/tokens.bin/00000",
            f"tokens/{ident}/blobs/000000000000-0badf00d/tokens.bin/00000"]

    class CannotList(LocalStore):
        def list(self, prefix=""):
            raise StoreUnavailable("injected: listing timed out")

    run = tmp_path / "runs" / "r"
    for key in lost:
        LocalStore(str(run)).put(key, b"lost")
    store, built = data_mod.load_with_report(cfg, tok, store=CannotList(str(run)), run_id="r")
    assert built.built and len(store) == 40
    assert "could not remove the parts of builds that never committed" in caplog.text
    assert all(LocalStore(str(run)).get(k) == b"lost" for k in lost)
    # The next build of the identity (the committed store torn, so built again) removes them, and keeps
    # every blob its manifest names: a node without a copy fetches and verifies them all.
    first = json.loads((run / "tokens" / ident / "manifests" / "000000000000.json").read_text())
    (run / "tokens" / ident / first["blobs"]["tokens.bin/00000"]["key"]).write_bytes(b"torn")
    shutil.rmtree(cache / "tokens" / ident)
    assert data_mod.load_with_report(cfg, tok, store=LocalStore(str(run)), run_id="r")[1].built
    keys = {o.key for o in LocalStore(str(run)).list(f"tokens/{ident}/")}
    assert not keys & set(lost)
    manifest = json.loads((run / "tokens" / ident / "manifests" / "000000000000.json").read_text())
    assert {f"tokens/{ident}/{ref['key']}" for ref in manifest["blobs"].values()} <= keys
    shutil.rmtree(cache / "tokens" / ident)
    assert not data_mod.load_with_report(cfg, tok, store=LocalStore(str(run)), run_id="r")[1].built


def test_a_corrupt_parquet_file_is_refused_in_one_printable_line(cache, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elastic_ft.train.datafiles import DataError

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"t": ["a" * 50] * 200}), str(good), compression="NONE")
    data = bytearray(good.read_bytes())
    data[8: len(data) // 2] = b"\xff" * (len(data) // 2 - 8)  # the pages and the footer's start overwritten
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(data))
    cfg = DataConfig(files=[str(bad)], text_field="t", max_length=32)
    with pytest.raises(DataError) as err:
        data_mod.load_with_report(cfg, byte_tokenizer(), store=_run_store(tmp_path), run_id="r")
    line = str(err.value)
    assert "data.files" in line and "bad.parquet" in line and "could not be read as parquet" in line
    assert line.isprintable(), repr(line)  # no newline, no raw byte of the file


def test_runs_with_the_same_data_share_the_node_copy_without_hashing_or_replacing_it(cache, tmp_path, monkeypatch):
    """An LR sweep: two runs (own run ids and locations) of the same data build their own committed stores
    (other writer and time, same bytes) that name one node copy. The second run's build and load, and a
    restart of either run, hash nothing and never replace the copy the first run maps."""
    from elastic_ft.train import token_files

    hashed: list[str] = []
    real = token_files.verify_file

    def counting(path, refs):
        hashed.append(path)
        return real(path, refs)

    monkeypatch.setattr(token_files, "verify_file", counting)
    path = write_jsonl(tmp_path / "d.jsonl", varied_rows(40))
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    first = LocalStore(str(tmp_path / "runs" / "lr-1"))
    second = LocalStore(str(tmp_path / "runs" / "lr-2"))
    mapped, report = data_mod.load_with_report(cfg, tok, store=first, run_id="lr-1")
    expected = np.array(mapped.tokens)
    copy = cache / "tokens" / report.identity / "tokens.bin"
    inode = os.stat(copy).st_ino
    store2, report2 = data_mod.load_with_report(cfg, tok, store=second, run_id="lr-2")
    assert report2.built and report2.identity == report.identity  # its own committed store, same identity
    assert os.stat(copy).st_ino == inode  # the copy the first run maps was kept, not replaced
    assert np.array_equal(np.array(store2.tokens), expected)
    for store, run_id in ((first, "lr-1"), (second, "lr-2"), (first, "lr-1")):  # restarts of either run
        again, rep = data_mod.load_with_report(cfg, tok, store=store, run_id=run_id)
        assert not rep.built and np.array_equal(np.array(again.tokens), expected)
    assert hashed == []
    assert os.stat(copy).st_ino == inode


@pytest.mark.parametrize("foreign", ["run", "format"])
def test_a_manifest_of_another_run_or_format_is_a_hard_stop_never_retired(cache, tmp_path, foreign):
    path = write_jsonl(tmp_path / "d.jsonl", varied_rows(40))
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    ident = data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id="r")[1].identity
    manifests = tmp_path / "runs" / "r" / "tokens" / ident / "manifests"
    run_id, why = "another", "belongs to run 'r'"
    if foreign == "format":  # a newer elastic_ft's store under this run
        (manifest,) = manifests.iterdir()
        doc = json.loads(manifest.read_bytes())
        doc["format"] = 99
        manifest.write_text(json.dumps(doc))
        run_id, why = "r", "has format 99"
    before = {p.name: p.read_bytes() for p in manifests.iterdir()}
    with pytest.raises(data_mod.DataError) as err:
        data_mod.load_with_report(cfg, tok, store=_run_store(tmp_path), run_id=run_id)
    line = str(err.value)
    assert "\n" not in line and f"tokens/{ident}" in line and why in line, line
    assert {p.name: p.read_bytes() for p in manifests.iterdir()} == before  # nothing retired or rebuilt over it
    assert not (tmp_path / "runs" / "r" / "tokens" / ident / "quarantine").exists()


def test_a_store_another_writer_of_the_run_committed_first_is_adopted(cache, tmp_path, monkeypatch):
    """Two jobs of one run build the same store; the other commits first. Its store is this one (same
    identity, same bytes): adopted, and the leader's node keeps its assembled copy without hashing it."""
    from elastic_ft.checkpoint.writer import CheckpointWriter
    from elastic_ft.train import token_build, token_files

    path = write_jsonl(tmp_path / "d.jsonl", varied_rows(40))
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    donor = tmp_path / "donor"
    ident = data_mod.load_with_report(cfg, tok, store=LocalStore(str(donor)), run_id="r")[1].identity
    expected = np.array(data_mod.load(cfg, tok, store=LocalStore(str(donor)), run_id="r").tokens)
    shutil.rmtree(cache)
    run = tmp_path / "runs" / "r"
    real_commit = CheckpointWriter.commit_manifest

    def other_job_first(self, snap, blobs):  # the other job's whole store lands just before our commit
        shutil.copytree(donor / "tokens" / ident, run / "tokens" / ident, dirs_exist_ok=True)
        return real_commit(self, snap, blobs)

    monkeypatch.setattr(token_build.CheckpointWriter, "commit_manifest", other_job_first)
    hashed: list[str] = []
    real_verify = token_files.verify_file
    monkeypatch.setattr(token_files, "verify_file", lambda p, refs: hashed.append(p) or real_verify(p, refs))
    store, report = data_mod.load_with_report(cfg, tok, store=LocalStore(str(run)), run_id="r")
    assert report.built and np.array_equal(np.array(store.tokens), expected)
    manifests = os.listdir(run / "tokens" / ident / "manifests")
    assert len(manifests) == 1 and hashed == []
    monkeypatch.setattr(token_build.CheckpointWriter, "commit_manifest", real_commit)
    assert not data_mod.load_with_report(cfg, tok, store=LocalStore(str(run)), run_id="r")[1].built


def test_local_ranks_starting_at_once_hash_a_data_file_once_and_keep_every_digest(tmp_path):
    """Two ranks of a node read files.json before either wrote it: the second finds the first's digest
    (under the node lock, read again) instead of hashing the file again, and its save keeps the first's."""
    from elastic_ft.train.token_identity import FileDigests

    a, b = write_jsonl(tmp_path / "a.jsonl", varied_rows(5)), write_jsonl(tmp_path / "b.jsonl", varied_rows(5, 1))
    record = str(tmp_path / "node" / "files.json")
    rank0, rank1 = FileDigests(record), FileDigests(record)
    opened: list[str] = []
    watched = {os.path.realpath(a)}

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and \
                os.path.realpath(os.fsdecode(args[0])) in watched:
            opened.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)  # cannot be removed; it only appends to this test's list
    try:
        digest_a = rank0.digest(a)
        assert len(opened) == 1
        assert rank1.digest(a) == digest_a and len(opened) == 1  # not hashed a second time
        rank1.digest(b)
    finally:
        watched = set()
    known = json.loads((tmp_path / "node" / "files.json").read_text())
    assert set(known) == {os.path.realpath(a), os.path.realpath(b)}


def test_the_store_exchanges_wait_for_the_datas_size_from_the_collective_timeout_floor_up_to_a_cap():
    from elastic_ft.train.token_exchange import (
        MAX_EXCHANGE_TIMEOUT_S, TRANSFER_BYTES_PER_S, WORK_PER_INPUT_BYTE, exchange_timeout,
    )

    assert exchange_timeout(0, 600.0) == 600.0  # the demo corpus: the collective timeout as it is
    # 30 GB of data on a slow link: the build and the fetch move about ten bytes per input byte at 20 MB/s.
    thirty_gb = exchange_timeout(30 * 10**9, 600.0)
    assert thirty_gb == 600.0 + 30e9 * WORK_PER_INPUT_BYTE / TRANSFER_BYTES_PER_S
    assert thirty_gb > 4 * 3600  # far beyond the 600 s that cut such a build short
    assert exchange_timeout(10**9, 60.0) < exchange_timeout(10**9, 600.0) < exchange_timeout(2 * 10**9, 600.0)
    assert exchange_timeout(10**15, 600.0) == MAX_EXCHANGE_TIMEOUT_S  # bounded, whatever the size
    assert exchange_timeout(-5, -1.0) == 0.0


def test_a_fetch_cut_short_is_resumed_from_its_last_whole_piece(cache, tmp_path, monkeypatch):
    """A node's fetch of a large store stopped by a store error (or a new world) keeps its verified pieces:
    the next start fetches only the rest, and the copy is the committed bytes."""
    from elastic_ft.checkpoint.errors import StoreUnavailable
    from elastic_ft.train import token_files

    monkeypatch.setattr(token_files, "PIECE_BYTES", 512)  # the test's store in many pieces
    path = write_jsonl(tmp_path / "d.jsonl", varied_rows(60))
    cfg = DataConfig(files=[path], prompt_field="q", response_field="a", max_length=32)
    tok = byte_tokenizer()
    run = str(tmp_path / "runs" / "r")
    good, built = data_mod.load_with_report(cfg, tok, store=LocalStore(run), run_id="r")
    expected = {name: (cache / "tokens" / built.identity / name).read_bytes() for name in os.listdir(
        cache / "tokens" / built.identity) if name != "verified.json"}
    shutil.rmtree(cache / "tokens" / built.identity)  # a node that never had it
    fetched: list[str] = []

    class Counting(LocalStore):
        fail_after: int | None = None

        def get_verified(self, key, **kw):
            if self.fail_after is not None and len(fetched) >= self.fail_after:
                raise StoreUnavailable(f"injected: {key} unavailable")
            fetched.append(key)
            return super().get_verified(key, **kw)

    cut = Counting(run)
    cut.fail_after = 7
    with pytest.raises(StoreUnavailable):
        data_mod.load_with_report(cfg, tok, store=cut, run_id="r")
    assert len(fetched) == 7
    fetched.clear()
    store, again = data_mod.load_with_report(cfg, tok, store=Counting(run), run_id="r")
    pieces = len([k for k in LocalStore(run).list(f"tokens/{built.identity}/blobs/")])
    assert not again.built and pieces > 10
    assert len(fetched) == pieces - 7  # only what the cut fetch had not landed
    for name, data in expected.items():
        assert (cache / "tokens" / built.identity / name).read_bytes() == data, name
    assert np.array_equal(np.array(store.tokens), np.array(good.tokens))
    assert not [n for n in os.listdir(cache / "tokens") if ".partial-" in n]
