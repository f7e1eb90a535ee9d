"""One check's outcome and how it prints: ``STATUS name: found[; fix: ...]``."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Literal

Status = Literal["PASS", "FAIL", "WARN", "SKIP"]


@dataclasses.dataclass(frozen=True)
class Result:
    """What one check decided."""

    status: Status
    name: str
    found: str
    """What the check saw, in a sentence a user can act on."""
    fix: str = ""
    """What to do about a FAIL or WARN; empty when there is nothing to do."""

    def line(self) -> str:
        fix = f"; fix: {self.fix}" if self.fix and self.status in ("FAIL", "WARN") else ""
        return f"{self.status:<4} {self.name}: {self.found}{fix}"


def exit_code(results: Iterable[Result]) -> int:
    """1 if any check failed, else 0 (a WARN is advice, not a failure)."""
    return 1 if any(r.status == "FAIL" for r in results) else 0
