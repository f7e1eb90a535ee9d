"""Plain YAML data onto typed dataclasses: the conversion half of loading a spec.

:func:`build_dataclass` walks a mapping against a dataclass's type hints
(nested dataclasses, ``X | None``, ``Literal``, ``list[X]``, ``dict``, and the
scalars) and collects every problem as (dotted field path, message), so a user
sees all of them at once. Range checks are config.validate's; here a value
only has to have the right type, and a float must be finite.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Literal, Union

from elastic_ft.config.bounds import Bound, show_value as _show
from elastic_ft.config.spec_yaml import HugeNumber

_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def build_dataclass(cls, raw: Any, problems: list[tuple[str, str]], *, limits: dict[str, Bound]):
    """An instance of ``cls`` from ``raw``, or None; problems are appended to ``problems``.

    A field whose value has the wrong type keeps its default (and has a
    problem). ``limits`` (dotted path -> range) only words the error for an
    integer too long to read (spec_yaml.HugeNumber) in the field's range.
    """
    return _Converter(problems, limits).build(cls, raw, "")


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


class _Converter:
    """One conversion: the problems found so far, and the ranges that word a huge number's error."""

    def __init__(self, problems: list[tuple[str, str]], limits: dict[str, Bound]) -> None:
        self.problems, self.limits = problems, limits

    def build(self, cls, raw: Any, path: str):
        if not isinstance(raw, dict):
            self.problems.append((path or "spec", f"must be a mapping, got {_show(raw)}"))
            return None
        hints = typing.get_type_hints(cls)
        fields = _fields(cls)
        kwargs = {}
        for key, value in raw.items():
            fpath = f"{path}.{key}" if path else str(key)
            if key not in fields:
                close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(fields)}"
                self.problems.append((fpath, f"unknown key{hint}"))
                continue
            ok, converted = self.convert(hints[key], value, fpath)
            if ok:
                kwargs[key] = converted
        try:
            return cls(**kwargs)
        except TypeError as exc:  # pragma: no cover - all fields have defaults
            self.problems.append((path or "spec", str(exc)))
            return None

    def convert(self, tp, value, path: str) -> tuple[bool, Any]:
        origin = typing.get_origin(tp)
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if value is None:
                return True, None
            if len(args) == 1:
                return self.convert(args[0], value, path)
            return self.convert_either(args, value, path)
        if origin is Literal:
            allowed = typing.get_args(tp)
            if value in allowed:
                return True, value
            self.problems.append((path, f"{_show(value)} is not one of {', '.join(map(repr, allowed))}"))
            return False, None
        if dataclasses.is_dataclass(tp):
            built = self.build(tp, value, path)
            return built is not None, built
        if origin is list:
            (item_tp,) = typing.get_args(tp)
            if not isinstance(value, list):
                self.problems.append((path, f"must be a list, got {_show(value)}"))
                return False, None
            items = []
            for i, v in enumerate(value):
                ok, c = self.convert(item_tp, v, f"{path}[{i}]")
                if not ok:
                    return False, None
                items.append(c)
            return True, items
        if tp is dict:
            if isinstance(value, dict):
                return self.plain_mapping(value, path), value
            self.problems.append((path, f"must be a mapping, got {_show(value)}"))
            return False, None
        if tp in (int, float) and isinstance(value, HugeNumber):
            bound = self.limits.get(re.sub(r"\[\d+\]$", "", path))
            message = f"must be in {bound}, got {value!r}" if bound else f"is out of range: got {value!r}"
            self.problems.append((path, message))
            return False, None
        if tp is bool:
            if isinstance(value, bool):
                return True, value
        elif tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True, value
        elif tp is float:
            return self.convert_float(value, path)
        elif tp is str:
            if isinstance(value, str):
                return True, value
        self.problems.append((path, f"must be {getattr(tp, '__name__', tp)}, got {_show(value)}"))
        return False, None

    def convert_either(self, args: tuple, value, path: str) -> tuple[bool, Any]:
        """``value`` as the first of ``args`` it converts to (``target_modules``: a list, or ``all-linear``);
        one problem naming every choice when none fits, not one per choice."""
        for tp in args:
            ok, converted = _Converter([], self.limits).convert(tp, value, path)
            if ok:
                return True, converted
        self.problems.append((path, f"must be {' or '.join(_describe_type(tp) for tp in args)}, got {_show(value)}"))
        return False, None

    def convert_float(self, value, path: str) -> tuple[bool, Any]:
        """A finite float from a number, or from a string like 1e-4 (PyYAML reads YAML 1.1, where that is a string)."""
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            number = value
        if number is None:
            self.problems.append((path, f"must be float, got {_show(value)}"))
            return False, None
        try:
            result = float(number)
        except OverflowError:  # an int beyond float range
            result = math.inf
        # Refused here for every float field, whatever its range: inf passed the old
        # "lr > 0" check and trained NaN weights.
        if not math.isfinite(result):
            self.problems.append((path, f"must be a finite number, got {_show(value)}"))
            return False, None
        return True, result

    def plain_mapping(self, value: dict, path: str) -> bool:
        """Check a free-form mapping (model.config) for numbers too long to use, naming the first."""
        stack = [(value, path)]
        while stack:
            node, where = stack.pop()
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for k, v in items:
                sub = f"{where}.{k}" if isinstance(node, dict) else f"{where}[{k}]"
                if isinstance(v, HugeNumber):
                    self.problems.append((sub, f"is out of range: got {v!r}"))
                    return False
                stack.append((v, sub))
        return True


def _describe_type(tp) -> str:
    """A type as a spec's reader would say it: ``a list of str``, ``'all-linear'``, ``bool``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    if origin is list:
        return f"a list of {_describe_type(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))
