"""Numeric ranges of configuration fields, and showing bad values briefly.

A range check is a table lookup (``config.LIMITS``), so every numeric field
has a stated range that errors quote, and no input can make the trainer
allocate, loop or overflow without limit.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Bound:
    """The allowed range of one numeric field; ``lo_open``/``hi_open`` exclude the end itself.

    Written as an interval in errors: ``[1, 16777216]``, ``(0.0, 10.0]``.
    """

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    words: tuple[str, ...] = ()
    """Named choices the field takes besides a number (``checkpoint.every_steps: auto``)."""

    def __str__(self) -> str:
        interval = f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        return interval + "".join(f" or {word!r}" for word in self.words)

    def contains(self, value: float | str) -> bool:
        """False for nan too (every comparison with nan is False)."""
        if isinstance(value, str):
            return value in self.words
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below


def show_value(value: Any) -> str:
    """``repr(value)``, shortened: a megabyte-long bad value must not become a megabyte-long error."""
    if isinstance(value, int) and value.bit_length() > 256:  # repr of a 5,000-digit int raises
        return f"<a number {value.bit_length()} bits long>"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def out_of_range(obj: Any, limits: dict[str, Bound]) -> list[tuple[str, str]]:
    """(field, message) for every dotted field of ``obj`` outside its bound.

    None values and fields under a None section (``lora: null``) are skipped;
    a list field is checked item by item (``optimizer.betas[1]``).
    """
    out = []
    for field, bound in limits.items():
        value: Any = obj
        for part in field.split("."):
            value = getattr(value, part) if value is not None else None
        values = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, v in values:
            if v is not None and not bound.contains(v):
                where = field if i is None else f"{field}[{i}]"
                out.append((where, f"must be in {bound}, got {show_value(v)}"))
    return out


def parse_number(text: str, kind: type, bound: Bound) -> float:
    """``text`` as ``kind`` (int or float) inside ``bound``; ValueError with a sentence otherwise.

    For command-line arguments; nan and inf are refused (``contains`` is False
    for nan, and no bound reaches infinity).
    """
    try:
        value = kind(text)
    except ValueError:  # includes an int too long to convert
        raise ValueError(f"must be {'a whole number' if kind is int else 'a number'}, got {show_value(text)}") from None
    if not bound.contains(value):
        raise ValueError(f"must be in {bound}, got {show_value(text)}")
    return value
