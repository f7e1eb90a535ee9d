"""JSON Lines are read one way: the data check (``datafiles.check_files``) and the token store's build
(``token_records.Records``) skip the same blank lines, count the same records and name the same
``data.files[I]:LINE`` in an error.

The check used to decide blankness on the decoded text (``str.strip``: NBSP, U+2028, ``\\x1c``-``\\x1f`` are
whitespace to it) and the build on the bytes (``bytes.strip``: ASCII only), so a line holding only a
no-break space passed the check and then failed the build with a bare ``JSONDecodeError`` naming no file
or line. A blank line is now JSON's (spaces, tabs, CR, LF only, as ``json`` and Arrow read it); any other
whitespace-only line is refused by both, naming its line.
"""

from __future__ import annotations

import json

import pytest

from elastic_ft.config import DataConfig
from elastic_ft.train import data as data_mod
from elastic_ft.train.datafiles import DataError, check_files
from elastic_ft.train.model import byte_tokenizer
from elastic_ft.train.token_records import Records, tokenize_share
from elastic_ft.train.token_store import token_dtype

GOOD = json.dumps({"prompt": "2+2=", "response": " 4"})
FIELDS = {"prompt_field": "prompt", "response_field": "response"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(tmp_path / "node-cache"))


def _file(tmp_path, name: str, lines: list[str]) -> str:
    path = tmp_path / name
    path.write_bytes(("\n".join(lines) + "\n").encode())
    return str(path)


def _build_error(cfg: DataConfig, tmp_path) -> str:
    """The error of the build's own reader (a rank tokenizing every record), with no check before it."""
    tok = byte_tokenizer()
    with pytest.raises(DataError) as info:
        records = Records(cfg, "json")
        tokenize_share(records, 0, records.count, cfg, tok, token_dtype(len(tok)), str(tmp_path / "part"))
    return str(info.value)


@pytest.mark.parametrize("space", ["\u00a0", "\u2028", "\x1c", "\x0c \u3000"],
                         ids=["nbsp", "line-separator", "file-separator", "form-feed-ideographic"])
def test_a_line_of_non_json_whitespace_is_refused_alike_by_the_check_and_the_build(tmp_path, space):
    path = _file(tmp_path, "d.jsonl", [GOOD, GOOD, space, GOOD])
    cfg = DataConfig(files=[path], **FIELDS)
    with pytest.raises(DataError) as info:
        check_files(cfg, "json")
    checked = str(info.value)
    assert checked.startswith("data.files[0]:3: only whitespace, some of it not whitespace to JSON (U+"), checked
    assert checked.endswith(f"; fix or remove line 3 of {path!r}") and "\n" not in checked
    assert _build_error(cfg, tmp_path) == checked
    with pytest.raises(DataError) as info:  # and the whole path (check, then build): the same line
        data_mod.load(cfg, byte_tokenizer())
    assert str(info.value) == checked


def test_json_blank_lines_are_skipped_alike_and_records_keep_their_line_numbers(tmp_path):
    bad = json.dumps({"prompt": 7, "response": " 4"})
    first = _file(tmp_path, "a.jsonl", [GOOD, "", "  \t", "\r", GOOD])
    second = _file(tmp_path, "b.jsonl", ["", GOOD, " ", bad, GOOD])
    cfg = DataConfig(files=[first, second], **FIELDS)
    records = Records(cfg, "json")
    assert records.count == 5
    assert [records.place(i) for i in range(records.count)] == [
        "data.files[0]:1", "data.files[0]:5", "data.files[1]:2", "data.files[1]:4", "data.files[1]:5"]
    with pytest.raises(DataError) as info:
        check_files(cfg, "json")
    checked = str(info.value)
    assert checked.startswith("data.files[1]:4: field 'prompt' is a number, not text; "), checked
    assert _build_error(cfg, tmp_path).startswith("data.files[1]:4: field 'prompt' is a number, not text; ")


def test_a_byte_order_mark_then_blank_first_line_is_blank_to_both(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf \n" + (GOOD + "\n").encode() * 2)
    cfg = DataConfig(files=[str(path)], **FIELDS)
    check_files(cfg, "json")
    records = Records(cfg, "json")
    assert records.count == 2 and records.place(0) == "data.files[0]:2"
    assert len(data_mod.load(cfg, byte_tokenizer())) == 2
