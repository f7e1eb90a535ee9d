"""A stand-in for a torchrun agent: ``python -m tests.warm.agent [--no-hold] CMD... [-- CMD...]`` runs each command in turn
as its child (as torchrun starts a worker: a session of its own), and exits with the last one's status once it
reads a line on stdin (or at once with ``--no-hold``). Its warm process lives as long as it does."""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    hold = argv[0] != "--no-hold"
    argv = argv[1:] if not hold else argv
    commands, current = [], []
    for arg in argv:
        if arg == "--":
            commands.append(current)
            current = []
        else:
            current.append(arg)
    commands.append(current)
    status = 0
    for cmd in commands:
        status = subprocess.Popen(cmd, start_new_session=True).wait()
        print(f"status {status}", flush=True)
    if hold:
        sys.stdin.readline()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
