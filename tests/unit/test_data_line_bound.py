"""A data file's lines are read with a bound (elastic_ft.train.datafiles.MAX_LINE_BYTES): one huge line is
refused naming its file, line and the bound, in the memory of the bound, not of the line.

A data file with one 1 GB line cost 2.4-4.5 GB of a rank's memory before it was refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from elastic_ft.config import DataConfig
from elastic_ft.train import datafiles
from elastic_ft.train.datafiles import DataError, check_files
from elastic_ft.train.token_records import Records

GOOD = json.dumps({"prompt": "2+2=", "response": " 4"})
FIELDS = {"prompt_field": "prompt", "response_field": "response"}


def _file(tmp_path, name: str, lines: list[str]) -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("name, fmt, fields, good", [
    ("corpus.jsonl", "json", FIELDS, GOOD),
    ("corpus.txt", "text", {"text_field": "text"}, "some text"),
])
def test_a_line_over_the_bound_is_named_with_the_bound(tmp_path, monkeypatch, name, fmt, fields, good):
    monkeypatch.setattr(datafiles, "MAX_LINE_BYTES", 2**20)  # 1 MiB, so the test writes little
    long = json.dumps({"prompt": "x" * 2**20, "response": " 4"}) if fmt == "json" else "x" * (2**20 + 1)
    path = _file(tmp_path, name, [good, good, long, good])
    with pytest.raises(DataError) as info:
        check_files(DataConfig(files=[path], format=fmt, **fields), fmt)
    assert str(info.value) == (
        f"data.files[0]:3: a line longer than 1 MiB (1,048,576 bytes), the most one record's line may hold; "
        f"split its text into several records; fix or remove line 3 of {path!r}")


def test_a_line_at_the_bound_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(datafiles, "MAX_LINE_BYTES", 4096)
    record = {"prompt": "", "response": " 4"}
    record["prompt"] = "x" * (4096 - len(json.dumps(record)))
    line = json.dumps(record)
    assert len(line) == 4096
    path = _file(tmp_path, "corpus.jsonl", [GOOD, line, GOOD])
    cfg = DataConfig(files=[path], **FIELDS)
    check_files(cfg, "json")
    records = Records(cfg, "json")  # the token store's build reads the line too
    assert [columns for _, columns in records.batches(0, records.count)] == [
        {field: [r[field] for r in (json.loads(GOOD), record, json.loads(GOOD))] for field in ("prompt", "response")}]


def test_the_line_reader_of_the_token_store_build_is_bounded_too(tmp_path, monkeypatch):
    # Records is what a rank reads to build its share of the store: the same bound, the same message.
    monkeypatch.setattr(datafiles, "MAX_LINE_BYTES", 1024)
    path = _file(tmp_path, "corpus.jsonl", [GOOD, "x" * 2000])
    with pytest.raises(DataError, match=r"^data.files\[0\]:2: a line longer than 1,024 bytes, the most"):
        Records(DataConfig(files=[path], **FIELDS), "json")


def test_a_json_document_over_its_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(datafiles, "MAX_DOCUMENT_BYTES", 1000)
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps([json.loads(GOOD)] * 100))
    with pytest.raises(DataError) as info:
        check_files(DataConfig(files=[str(path)], **FIELDS), "json")
    assert str(info.value).startswith(f"data.files[0]: {str(path)!r} is one JSON document of "
                                      f"{path.stat().st_size:,} bytes, "
                                      f"more than 1,000 bytes; a document is read whole, so write large data as JSON Lines")


_CHILD = textwrap.dedent("""
    import json, resource, sys
    from elastic_ft.config import DataConfig
    from elastic_ft.train.datafiles import DataError, check_files
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        check_files(DataConfig(files=[sys.argv[1]], format=sys.argv[2], **json.loads(sys.argv[3])), sys.argv[2])
    except DataError as exc:
        message = str(exc)
    else:
        message = None
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"message": message, "grew_kib": after - before}))
""")


@pytest.mark.parametrize("name, fmt, fields", [
    ("big.jsonl", "json", FIELDS),
    ("big.txt", "text", {"text_field": "text"}),
])
@pytest.mark.subprocess  # runs bash / a child python
def test_a_300_mb_line_is_refused_in_the_memory_of_the_bound(tmp_path, name, fmt, fields):
    """A sparse file (no disk used): good lines, then one 300 MB line of NUL bytes. The child's peak RSS
    grows by at most a few times the 16 MiB bound; the old code read the line whole (600 MB and more)."""
    path = tmp_path / name
    head = "\n".join([GOOD if fmt == "json" else "some text"] * 3) + "\n"
    with open(path, "wb") as f:
        f.write(head.encode())
        f.truncate(len(head) + 300 * 2**20)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), fmt, json.dumps(fields)],
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    print(f"peak RSS grew by {result['grew_kib'] / 1024:.0f} MiB")
    assert result["grew_kib"] < 64 * 1024, f"peak RSS grew by {result['grew_kib'] / 1024:.0f} MiB"
    assert result["message"] == (
        f"data.files[0]:4: a line longer than 16 MiB (16,777,216 bytes), the most one record's line may hold; "
        f"split its text into several records; fix or remove line 4 of {str(path)!r}")
