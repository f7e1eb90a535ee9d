"""A worker for the warm-start tests: ``python -m tests.warm.probe ACTION``, started through the launcher.

Its preload imports :mod:`tests.warm.preloaded`; the fork prints one line of facts (``facts {...}``)
and then does ACTION: ``exit N``; ``wait`` (prints ``ready``, waits for SIGTERM, answers
``got SIGTERM`` and exits 43); ``spin`` (prints ``ready`` and loops); ``killself`` (SIGKILLs itself).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def preload() -> None:
    if os.environ.get("PROBE_PRELOAD_FAIL"):
        raise RuntimeError("this preload fails (PROBE_PRELOAD_FAIL)")
    import tests.warm.preloaded  # noqa: F401 - its presence in a fork's sys.modules is the proof


def facts() -> dict:
    from elastic_ft.handoff import launch

    return {"pid": os.getpid(), "ppid": os.getppid(), "launcher": launch.worker_pid(), "agent": launch.agent_pid(),
            "warm": launch.forked_warm(), "preloaded": "tests.warm.preloaded" in sys.modules,
            "cwd": os.getcwd(), "argv": sys.argv[1:], "probe_env": os.environ.get("PROBE_ENV"),
            "rank": os.environ.get("RANK")}


def act(action: list[str]) -> int:
    print("facts " + json.dumps(facts()), flush=True)
    if action[0] == "exit":
        return int(action[1])
    if action[0] in ("wait", "spin"):
        def on_term(_signum, _frame):
            print("got SIGTERM", flush=True)
            os._exit(43)

        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    if action[0] == "killself":
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    from elastic_ft.handoff import launch

    if not launch.forked_warm():
        from elastic_ft.warm import client

        client.run("tests.warm.probe", "tests.warm.probe:preload")
    sys.exit(act(sys.argv[1:]))
