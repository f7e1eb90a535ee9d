"""Which processes torchrun started for this worker: its own, and its agent.

torchrun starts each worker as a child of its agent, so ``os.getpid()`` and
``os.getppid()`` name them. A worker forked by the node's warm process
(:mod:`elastic_ft.warm`) is not: torchrun's child is the small launcher that
asked for it, and the agent is that launcher's parent. Everything that names
the worker's process or its agent (the leave marker's owner, the run lease's
holder, the start times goodput counts from) asks here, so both starts name
the same processes.
"""

from __future__ import annotations

import os

_adopted: tuple[int, int] | None = None


def adopt(launcher_pid: int, agent_pid: int) -> None:
    """Called once by a warm-forked worker, before the job runs: torchrun's child and its agent."""
    global _adopted
    _adopted = (launcher_pid, agent_pid)


def worker_pid() -> int:
    """The pid torchrun started for this worker (and signals, and watches)."""
    return _adopted[0] if _adopted else os.getpid()


def agent_pid() -> int:
    """The pid of this worker's torchrun agent (its parent when not forked warm)."""
    return _adopted[1] if _adopted else os.getppid()


def start_ticks(pid: int | str) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot (/proc, Linux); None if it is gone or unreadable.

    With the pid it names one process for good: a pid reused after the process ended has another start."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses: split after its closing one.
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def forked_warm() -> bool:
    """Whether this worker was forked by the node's warm process (its libraries imported before it started)."""
    return _adopted is not None
