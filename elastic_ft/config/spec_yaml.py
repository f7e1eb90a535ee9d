"""YAML from users (spec files and ``field=value`` overrides), read with bounds.

PyYAML's ``safe_load`` is safe from code execution, not from size: aliases
(``*name``) share one node, so a few hundred bytes of nested aliases (a
"billion laughs") load quickly and explode when anything copies or serialises
the result (the override copy took 8 GB before failing). An integer with
100,000 digits fails in ``int()`` with a traceback; nesting a few hundred
levels deep fails with ``RecursionError``.

:func:`load_yaml` parses with PyYAML's safe loader, then measures the composed
node graph (shared nodes counted once per reference, without expanding it)
and refuses a document whose aliases add more than :data:`MAX_ALIAS_EXPANSION`
values, one that refers to itself, or one nested deeper than
:data:`MAX_DEPTH`. Integers longer than :data:`MAX_NUMBER_CHARS` characters
load as a :class:`HugeNumber`, so the spec's validation can name the field.

A key given twice in one mapping (``optimizer:`` twice, ``steps:`` twice, at
any depth) is refused with both line numbers: PyYAML keeps the last silently,
so a second block would replace the first without a word. Keys brought in by a
merge (``<<: *base``) may be overridden; that is what merging is for.
"""

from __future__ import annotations

import yaml

MAX_ALIAS_EXPANSION = 10_000
"""Extra values that aliases may add to a document (a spec uses a handful)."""
MAX_DEPTH = 64
"""Nesting of mappings and lists; a job spec needs fewer than ten levels."""
MAX_NUMBER_CHARS = 100
"""Longer integers are never valid in a spec: every numeric field is bounded far below."""
MAX_FILE_BYTES = 16 * 2**20
"""A spec is a few kilobytes; a larger file is not one (and would be read into memory whole)."""


class YamlInputError(ValueError):
    """A YAML document that is refused for its size or shape (not its syntax)."""


class HugeNumber:
    """An integer too long to convert; validation reports it against the field's range."""

    def __init__(self, text: str) -> None:
        self.chars = len(text)

    def __repr__(self) -> str:
        return f"<a number {self.chars} characters long>"


class _BoundedLoader(yaml.SafeLoader):
    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _check_graph(node)
            _check_duplicate_keys(node)
        return node

    def construct_yaml_int(self, node):
        if isinstance(node.value, str) and len(node.value) > MAX_NUMBER_CHARS:
            return HugeNumber(node.value)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def load_yaml(text: str):
    """Parse one YAML document with the bounds above.

    Raises :class:`yaml.YAMLError` for syntax errors (with PyYAML's line and
    column) and :class:`YamlInputError` for a refused size or shape.
    """
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError as exc:  # PyYAML's composer recurses once per nesting level
        raise YamlInputError(f"is nested more than {MAX_DEPTH} levels deep") from exc


def read_yaml_file(path: str):
    """The YAML document in file ``path``, bounded as :func:`load_yaml` is.

    Raises :class:`YamlInputError` with one sentence naming the file for every
    problem: missing, a directory, unreadable, larger than
    :data:`MAX_FILE_BYTES`, not UTF-8, not valid YAML, or refused by the bounds.
    """
    def fail(msg: str, exc: BaseException | None = None):
        raise YamlInputError(f"file {path!r} {msg}") from exc

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError as exc:
        fail("does not exist", exc)
    except IsADirectoryError as exc:
        fail("is a directory; give the path of a YAML file, e.g. specs/tiny-lora.yaml", exc)
    except OSError as exc:
        fail(f"cannot be read: {exc.strerror or exc}", exc)
    if len(data) > MAX_FILE_BYTES:
        fail(f"is larger than {MAX_FILE_BYTES // 2**20} MiB; a job spec is a small YAML file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); a job spec is YAML text", exc)
    try:
        return load_yaml(text)
    except yaml.YAMLError as exc:
        fail(f"is not valid YAML: {exc}", exc)
    except YamlInputError as exc:
        fail(f"is refused: it {exc}", exc)


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_duplicate_keys(root) -> None:
    """Refuse a mapping that spells a key twice, naming its dotted path and both lines.

    Keys compare by tag and text (``steps`` and ``'steps'`` are the same key;
    a spec's keys are plain strings). Each distinct node is visited once, so
    aliases cost nothing extra; the walk is iterative (depth is checked first).
    """
    seen: set[int] = set()
    stack: list[tuple[object, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], yaml.Node] = {}
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode):
                    continue
                name = f"{path}.{key.value}" if path else str(key.value)
                if key.tag != "tag:yaml.org,2002:merge":
                    earlier = first.setdefault((key.tag, key.value), key)
                    if earlier is not key:
                        a, b = earlier.start_mark.line + 1, key.start_mark.line + 1
                        where = f"lines {a} and {b}" if a != b else f"twice on line {a}"
                        raise YamlInputError(
                            f"gives key {name!r} twice ({where}); "
                            f"the second would silently replace the first: give it once"
                        )
                stack.append((value, name))


def _check_graph(root) -> None:
    """Refuse alias expansion beyond the limit, self-reference and deep nesting.

    An iterative depth-first walk over the node graph: each distinct node is
    visited once, and its expanded size (values it stands for, counting every
    alias reference in full) and height come from its children's. Sizes are
    capped just above the limit so a bomb's astronomic count stays a small int.
    """
    cap = MAX_ALIAS_EXPANSION * 10 + 1
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            kids = _children(node)
            size[key] = min(cap, 1 + sum(size[id(c)] for c in kids))
            height[key] = 1 + max((height[id(c)] for c in kids), default=0)
            if height[key] > MAX_DEPTH:
                raise YamlInputError(f"is nested more than {MAX_DEPTH} levels deep")
            continue
        if key in size:
            continue
        if key in on_path:
            raise YamlInputError(
                f"an alias (*name) refers to a value that contains it (line {node.start_mark.line + 1}); "
                f"a spec cannot be recursive"
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    if size[id(root)] - len(size) > MAX_ALIAS_EXPANSION:
        raise YamlInputError(
            f"aliases (*name) expand it to more than {MAX_ALIAS_EXPANSION:,} values beyond what it spells out; "
            f"write the values out instead of nesting aliases"
        )
