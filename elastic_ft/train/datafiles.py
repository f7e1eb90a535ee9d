"""Local data files checked line by line before ``datasets`` reads them.

``datasets`` reports a bad JSON Lines file as "An error occurred while
generating the dataset" (at best an Arrow row number), passes a record that
lacks a field on as a null that crashes the tokenizer, and lets bytes that are
not UTF-8 through until a column is read. So every json and text file is read
once here first, and the first unusable line is named as ``data.files[I]:LINE``
with what is wrong and what to do. The scan is one pass of ``json.loads`` per
line: small next to tokenizing the same texts, which every rank does anyway.

Edge cases: a leading UTF-8 byte-order mark is ignored (``datasets`` strips it
too); blank lines in JSON Lines are skipped (Arrow skips them); a file that is
one JSON document (a list of records, or an object) is checked as a whole, its
records numbered from 1; a field that no record has is reported as the spec's
mistake (the field name), not as a line of the data.

A blank line of JSON Lines holds only JSON's whitespace (space, tab, CR, LF),
as ``json`` and Arrow read it; a line of other Unicode whitespace (NBSP,
U+2028) is refused naming its line. The token store's build reads JSON Lines
through the same reader (:func:`json_records`), so the check and the build
skip, count and number the records alike.

Memory: a line is read with a bound (:data:`MAX_LINE_BYTES`) before it is
read whole, so a file with one huge line is refused, naming its file and
line, at the cost of the bound (one 1 GB line took 2.4-4.5 GB of a rank's
memory before it was refused). A file that is one JSON document is parsed
whole (that is its format); it is refused above :data:`MAX_DOCUMENT_BYTES`
before it is read. Cost: one pass over the files, memory of one line.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from typing import BinaryIO

from elastic_ft.config import DataConfig


class DataError(ValueError):
    """The data section of the spec cannot be loaded."""


MAX_LINE_BYTES = 16 * 2**20
"""The longest line (one record) read: 16 MiB. A record of the longest ``data.max_length`` (2^17 tokens)
is well under 1 MiB of text; a line past this is refused before it is read whole (every rank reads the
files, so a huge line costs a few times its size on each)."""

MAX_DOCUMENT_BYTES = 256 * 2**20
"""The largest data file that is one JSON document (an array of records), which is parsed whole; larger
data belongs in JSON Lines, read a line at a time."""

_MiB = 2**20


def _size(n: int) -> str:
    return f"{n // _MiB} MiB ({n:,} bytes)" if n >= _MiB and n % _MiB == 0 else f"{n:,} bytes"


def _lines(f: BinaryIO, where: str, path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of each line of ``f``, newline kept; a line longer than
    :data:`MAX_LINE_BYTES` (newline not counted) raises :class:`DataError` naming it, having read
    no more than the bound of it."""
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise _line_error(where, path, lineno,
                              f"a line longer than {_size(MAX_LINE_BYTES)}, the most "
                              f"one record's line may hold; split its text into several records")
        yield lineno, raw


def _document_too_large(where: str, path: str) -> DataError | None:
    size = os.path.getsize(path)
    if size <= MAX_DOCUMENT_BYTES:
        return None
    return DataError(f"{where}: {path!r} is one JSON document of {size:,} bytes, more than "
                     f"{_size(MAX_DOCUMENT_BYTES)}; a document is read whole, so write large data as "
                     f"JSON Lines (one record a line), which is read a line at a time")


def needed_fields(cfg: DataConfig) -> dict[str, str]:
    """The record fields the spec reads, each with the spec field that names it."""
    if cfg.messages_field:
        return {cfg.messages_field: MESSAGES_SPEC_FIELD}
    if cfg.prompt_field:
        return {cfg.prompt_field: "data.prompt_field", cfg.response_field: "data.response_field"}
    return {cfg.text_field: "data.text_field"}


def missing_field_error(field: str, columns) -> DataError:
    return DataError(f"data field {field!r} is not in the data; it has columns {sorted(columns)}")


def kind_of(value) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


MESSAGES_SPEC_FIELD = "data.messages_field"

ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have (OpenAI's and Hugging Face's); only ``assistant`` turns are trained.
Another role (ShareGPT's ``human``/``gpt``) is refused rather than guessed."""


def conversation_problem(value, field: str) -> str | None:
    """Why ``value`` (a record's ``field``) is not a conversation that can be trained on, or None: not a
    non-empty list of ``{"role", "content"}`` objects with roles in :data:`ROLES` and text content, or no
    assistant turn (nothing to train)."""
    if not isinstance(value, list):
        return f"field {field!r} is {kind_of(value)}, not a list of messages"
    if not value:
        return f"field {field!r} is an empty list; a conversation needs messages"
    for n, message in enumerate(value, 1):
        where = f"field {field!r} message {n}"
        if not isinstance(message, dict):
            return f"{where} is {kind_of(message)}, not an object with 'role' and 'content'"
        if message.get("role") is None:
            return f"{where} has no 'role' (one of {', '.join(ROLES)})"
        if message["role"] not in ROLES:
            return f"{where} has role {message['role']!r}, not one of {', '.join(ROLES)}"
        if "content" not in message:
            return f"{where} has no 'content'"
        if not isinstance(message["content"], str):
            return f"{where} has 'content' that is {kind_of(message['content'])}, not text"
    if not any(m["role"] == "assistant" for m in value):
        return f"field {field!r} has no assistant turn, so nothing in it would be trained"
    return None


def record_problem(value, fields: dict[str, str]) -> str | None:
    """Why a parsed record cannot be trained on (not an object, a needed field absent, not text or not a
    conversation), or None."""
    if not isinstance(value, dict):
        return f"{kind_of(value)}, not a JSON object with field(s) {', '.join(map(repr, fields))}"
    for field, spec_field in fields.items():
        if field not in value:
            return f"no field {field!r} ({spec_field}); the record has {sorted(value)}"
        if spec_field == MESSAGES_SPEC_FIELD:
            if (problem := conversation_problem(value[field], field)) is not None:
                return problem
        elif not isinstance(value[field], str):
            return f"field {field!r} is {kind_of(value[field])}, not text"
    return None


BLANK = object()
"""What :func:`parse_line` returns for a blank line."""

JSON_WHITESPACE = " \t\r\n"
"""The whitespace of JSON's grammar, the only characters a blank line of JSON Lines holds (``json`` and Arrow
read the same). Other Unicode whitespace (NBSP, U+2028, ``\\x1c``) is not JSON's: such a line is refused,
naming it, by the check and the build alike (both read through :func:`json_records`)."""
_JSON_WHITESPACE_BYTES = JSON_WHITESPACE.encode()


class LineProblem(ValueError):
    """One line cannot be read; ``str(exc)`` says why."""


class UnreadableLine(DataError):
    """A line of a JSON Lines file is not a JSON value (or not UTF-8); the message names its file and line."""


def _not_utf8(raw: bytes, exc: UnicodeDecodeError) -> LineProblem:
    return LineProblem(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line)")


def is_blank(raw: bytes, *, first: bool = False) -> bool:
    """Whether a line of bytes (a file's ``first``, which may start with a byte-order mark) holds only
    :data:`JSON_WHITESPACE`: decided on the bytes, so counting records parses nothing."""
    if first:
        raw = raw.removeprefix(codecs.BOM_UTF8)
    return not raw.strip(_JSON_WHITESPACE_BYTES)


def parse_line(raw: bytes, *, first: bool = False):
    """The JSON value of one line of bytes, or :data:`BLANK`; raises :class:`LineProblem` saying why not."""
    if is_blank(raw, first=first):
        return BLANK
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(raw, exc) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if not text.strip():
            others = sorted({f"U+{ord(c):04X}" for c in text if c not in JSON_WHITESPACE})
            raise LineProblem(f"only whitespace, some of it not whitespace to JSON ({', '.join(others)}); a blank "
                              f"line may hold only spaces, tabs and line ends") from None
        raise LineProblem(f"not valid JSON ({exc.msg} at column {exc.colno})") from None


def line_records(f: BinaryIO, where: str, path: str, *, skip: int = 0,
                 parse: bool = True) -> Iterator[tuple[int, object]]:
    """``(line number, JSON value)`` of each non-blank line of the JSON Lines file ``f`` (``path``, named
    ``where``), in order: the first ``skip`` records, or all unless ``parse``, counted but not parsed (value
    None). Raises :class:`UnreadableLine` naming the line of a value that cannot be parsed, and
    :class:`DataError` for a line past :data:`MAX_LINE_BYTES`. Memory: one line (of the bound at most)."""
    seen = 0
    for lineno, raw in _lines(f, where, path):
        if is_blank(raw, first=lineno == 1):
            continue
        seen += 1
        if not parse or seen <= skip:
            yield lineno, None
            continue
        try:
            value = parse_line(raw, first=lineno == 1)
        except LineProblem as exc:
            raise _line_error(where, path, lineno, str(exc), UnreadableLine) from None
        yield lineno, value


def json_records(paths: list[str], *, skip: int = 0, parse: bool = True) -> Iterator[tuple[str, int, object]]:
    """``(data.files[I], line number, JSON value)`` of every record of the JSON Lines files ``paths`` (the spec's
    ``data.files``, in order): :func:`line_records` across files, the first ``skip`` records not parsed. The one
    reader of JSON Lines records: the check and the token store's build count, skip and number them alike."""
    for index, path in enumerate(paths):
        with open(path, "rb") as f:
            for lineno, value in line_records(f, f"data.files[{index}]", path, skip=skip, parse=parse):
                skip = max(0, skip - 1)
                yield f"data.files[{index}]", lineno, value


def check_files(cfg: DataConfig, fmt: str) -> None:
    """Raise :class:`DataError` for the first empty file or unusable line of ``cfg.files`` read as ``fmt``."""
    fields = needed_fields(cfg)
    for index, path in enumerate(cfg.files):
        where = f"data.files[{index}]"
        if os.path.getsize(path) == 0:
            raise DataError(f"{where}: {path!r} is empty; add records to it or remove it from data.files")
        if fmt == "json":
            _check_json(path, where, fields)
        elif fmt == "text":
            _check_text(path, where)


def _line_error(where: str, path: str, lineno: int, problem: str, kind: type[DataError] = DataError) -> DataError:
    return kind(f"{where}:{lineno}: {problem}; fix or remove line {lineno} of {path!r}")


def _blank_error(where: str, path: str) -> DataError:
    return DataError(f"{where}: {path!r} has only blank lines; add records to it or remove it from data.files")


def json_head(path: str) -> bytes:
    """The first bytes of a JSON file past a byte-order mark and whitespace: ``[`` starts one JSON array
    document (parsed whole), anything else is read as JSON Lines."""
    with open(path, "rb") as f:
        return f.read(4096).lstrip(codecs.BOM_UTF8).lstrip()


def _check_json(path: str, where: str, fields: dict[str, str]) -> None:
    head = json_head(path)
    if head.startswith(b"["):
        return _check_json_document(path, where, fields)
    seen: set[str] = set()
    first: DataError | None = None
    records = 0
    with open(path, "rb") as f:
        try:
            for lineno, value in line_records(f, where, path):
                records += 1
                problem = record_problem(value, fields)
                if problem is not None and not isinstance(value, dict):
                    raise _line_error(where, path, lineno, problem)
                seen.update(value)
                if problem is not None and first is None:
                    # Keep reading: a field that no record has is the spec's mistake, reported as such.
                    first = _line_error(where, path, lineno, problem)
        except UnreadableLine:
            if records == 0 and head.startswith(b"{") and _is_json_document(path, where):
                return  # one (pretty-printed) JSON object: datasets reads it column-wise
            raise
    if records == 0:
        raise _blank_error(where, path)
    _raise_field_problems(fields, seen, first)


def _raise_field_problems(fields: dict[str, str], seen: set[str], first: DataError | None) -> None:
    """A field in no record is the spec's mistake (say which fields exist); otherwise the first bad record."""
    for field in fields:
        if field not in seen:
            raise missing_field_error(field, seen)
    if first is not None:
        raise first


def _is_json_document(path: str, where: str) -> bool:
    too_large = _document_too_large(where, path)
    if too_large is not None:
        raise too_large
    try:
        with open(path, encoding="utf-8-sig") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _check_json_document(path: str, where: str, fields: dict[str, str]) -> None:
    """A file holding one JSON array: records (objects, or strings read as a 'text' field) numbered from 1."""
    too_large = _document_too_large(where, path)
    if too_large is not None:
        raise too_large
    with open(path, "rb") as f:
        data = f.read()
    try:
        doc = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise _line_error(where, path, lineno, f"not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    except json.JSONDecodeError as exc:
        raise _line_error(where, path, exc.lineno, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not doc:
        raise DataError(f"{where}: {path!r} is an empty JSON array; add records to it or remove it from data.files")
    seen: set[str] = set()
    first: DataError | None = None
    for number, value in enumerate(doc, 1):
        record = {"text": value} if isinstance(value, str) else value
        problem = record_problem(record, fields)
        if problem is not None and first is None:
            first = DataError(f"{where} record {number}: {problem}; fix or remove record {number} of {path!r}")
            if not isinstance(record, dict):
                raise first
        if isinstance(record, dict):
            seen.update(record)
    _raise_field_problems(fields, seen, first)


def _check_text(path: str, where: str) -> None:
    blank = True
    with open(path, "rb") as f:
        for lineno, raw in _lines(f, where, path):
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise _line_error(where, path, lineno, str(_not_utf8(raw, exc))) from None
            blank = blank and not text.strip()
    if blank:
        raise _blank_error(where, path)
