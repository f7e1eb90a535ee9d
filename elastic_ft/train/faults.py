"""Deterministic fault injection by (rank, step, restart), for tests and drills.

``ELASTIC_FT_FAULTS="kill:rank=1,step=7,restart=0"`` makes the worker of rank 1
SIGKILL itself at the start of step 7 in the first attempt only, the way a
lost machine would end it: no cleanup, no final checkpoint. Several faults
are separated by ``;``. Unset, this costs one dict lookup per step.

Actions:
- ``kill``: SIGKILL the worker at the start of the step.
- ``nan_loss``: the step's loss on that rank is NaN before its backward pass,
  as an overflow in the forward pass makes it (so its gradient is NaN too).
- ``nan_weight``: one trainable tensor on that rank is set to NaN at the start
  of the step, and stays so: every later loss is NaN.
- ``fail_load``: that rank's read of the checkpoint chosen at resume fails with
  an I/O error (a rank that cannot reach the store); ``step`` does not apply.
- ``kill_build``: SIGKILL the worker while the world builds the token store
  (:mod:`elastic_ft.train.token_build`), at ``point=share`` (its share is
  tokenized, its part not yet uploaded; the default) or ``point=commit`` (the
  leader: the store's blobs are uploaded, its manifest not yet written);
  ``step`` does not apply.
The trainer asks :meth:`Injector.fires` for the ``nan_*`` actions where they apply.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal

ENV = "ELASTIC_FT_FAULTS"
ACTIONS = ("kill", "nan_loss", "nan_weight", "fail_load", "kill_build")
BUILD_POINTS = ("share", "commit")


@dataclasses.dataclass(frozen=True)
class Fault:
    action: str
    rank: int | None
    step: int | None
    restart: int | None
    point: str | None = None
    """``kill_build`` only: where in the build (:data:`BUILD_POINTS`)."""


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        action, _, rest = item.partition(":")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown fault action {action!r} in {item!r}; supported: {', '.join(ACTIONS)}")
        pairs = [kv.split("=", 1) for kv in rest.split(",") if kv]
        fields = dict(p for p in pairs if len(p) == 2)
        if action == "kill_build":
            if set(fields) - {"rank", "restart", "point"} or len(fields) != len(pairs) \
                    or fields.get("point", "share") not in BUILD_POINTS:
                raise ValueError(f"{ENV}: {item!r} accepts only rank, restart and point={'|'.join(BUILD_POINTS)}")
        unknown = set(fields) - {"rank", "step", "restart"}
        if action not in ("fail_load", "kill_build") and (unknown or "step" not in fields or len(fields) != len(pairs)):
            raise ValueError(f"{ENV}: {item!r} needs step=N and accepts only rank, step, restart")
        if action == "fail_load" and (unknown or "step" in fields or len(fields) != len(pairs)):
            raise ValueError(f"{ENV}: {item!r} accepts only rank and restart")
        try:
            get = lambda k: int(fields[k]) if k in fields else None  # noqa: E731
            faults.append(Fault(action, get("rank"), get("step"), get("restart"),
                                fields.get("point", "share") if action == "kill_build" else None))
        except ValueError as exc:
            raise ValueError(f"{ENV}: {item!r} has a value that is not an integer") from exc
    return faults


class Injector:
    def __init__(self, faults: list[Fault], restart: int) -> None:
        self.faults, self.restart = faults, restart

    @classmethod
    def from_env(cls) -> "Injector":
        return cls(parse(os.environ.get(ENV, "")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def fires(self, action: str, *, rank: int, step: int) -> bool:
        """Whether a fault of ``action`` is set for this rank, step and restart."""
        return any(
            f.action == action and f.step == step and f.rank in (None, rank) and f.restart in (None, self.restart)
            for f in self.faults
        )

    def maybe_fire(self, *, rank: int, step: int) -> None:
        """Perform the ``kill`` faults due now (the ``nan_*`` ones are applied by the trainer)."""
        if self.faults and self.fires("kill", rank=rank, step=step):
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_kill_build(self, *, rank: int, point: str) -> None:
        """Perform the ``kill_build`` faults set for this rank, restart and ``point`` of the token store's build."""
        for f in self.faults:
            if f.action == "kill_build" and f.point == point and f.rank in (None, rank) \
                    and f.restart in (None, self.restart):
                os.kill(os.getpid(), signal.SIGKILL)

    def maybe_fail_load(self, *, rank: int) -> None:
        """Raise the I/O error a ``fail_load`` fault asks for on this rank (at the checkpoint read of resume)."""
        for f in self.faults:
            if f.action == "fail_load" and f.rank in (None, rank) and f.restart in (None, self.restart):
                raise OSError(errno.EIO, f"injected checkpoint read failure on rank {rank} ({ENV})")
