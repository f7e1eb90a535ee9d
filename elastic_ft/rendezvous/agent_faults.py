"""Deterministic holds of a torchrun agent at a phase of its round, for tests and drills.

``ELASTIC_FT_AGENT_HOLD="assign_ranks:/tmp/holds"`` makes the etcd3 agent stop
the first time it reaches that phase: it writes ``<dir>/<phase>.<pid>`` (JSON:
its pid and group rank in the round) and waits until ``<dir>/release`` exists,
then goes on. A test holds every node there, kills one (its whole process
tree), releases the others and checks what they do next: the agent-side
counterpart of :mod:`elastic_ft.faults`, which acts on workers by rank and step.

Phases (in the order torch's agent passes them after a round completes):
- ``assign_ranks``: the round is complete (every member met), torch's agent
  is about to exchange its workers' ranks through the round's store.
- ``start_workers``: the ranks are assigned, torch's agent is starting this
  node's workers (they have not been spawned yet).

Each phase holds once per agent process. A hold ends after
:data:`HOLD_LIMIT_S` even without the release file, with a warning, so a
forgotten hold never wedges an agent. Unset, a phase costs one attribute test.
"""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger(__name__)

ENV = "ELASTIC_FT_AGENT_HOLD"
PHASES = ("assign_ranks", "start_workers")
RELEASE = "release"
HOLD_LIMIT_S = 600.0
"""Longest hold: a test that forgot to release it fails on its own deadline, the agent goes on."""


def _parse(text: str) -> tuple[str, str] | None:
    if not text:
        return None
    phase, sep, folder = text.partition(":")
    if phase not in PHASES or not sep or not folder:
        raise ValueError(f"{ENV}={text!r}: expected PHASE:DIRECTORY with PHASE one of {', '.join(PHASES)}.")
    return phase, folder


_HOLD = _parse(os.environ.get(ENV, ""))
_held: set[str] = set()


def hold_at(phase: str, group_rank: int | None) -> None:
    """Hold this agent at ``phase`` if :data:`ENV` asks for it (once per process); see the module docstring."""
    if _HOLD is None or _HOLD[0] != phase or phase in _held:
        return
    _held.add(phase)
    folder = _HOLD[1]
    os.makedirs(folder, exist_ok=True)
    mark = os.path.join(folder, f"{phase}.{os.getpid()}")
    with open(mark + ".tmp", "w") as out:
        json.dump({"pid": os.getpid(), "group_rank": group_rank}, out)
    os.replace(mark + ".tmp", mark)
    log.warning("%s: agent %d (group rank %s) held at %s until %s exists.", ENV, os.getpid(), group_rank,
                phase, os.path.join(folder, RELEASE))
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not os.path.exists(os.path.join(folder, RELEASE)):
        if time.monotonic() > deadline:
            log.warning("%s: no release after %.0f s; agent %d goes on.", ENV, HOLD_LIMIT_S, os.getpid())
            return
        time.sleep(0.1)
