"""A replayed run's costs, from its events: what bench/trace_replay.py measures, and the model's fields from them.

Pure (no process, no clock): the calibration run's events and the replay's
give each part of a restart in seconds as ``elastic-ft goodput`` attributes it
(:func:`costs_of`), the run's attempts (:func:`attempts_of`), and the goodput
model's cost fields (bench/goodput_costs.py) taken from those measures
(:func:`model_costs`). Cost: O(events x (kills + joins)) per run.
"""

from __future__ import annotations

import statistics

GLOBAL_BATCH, MICRO_BATCH = 32, 8  # specs/tiny-lora.yaml's batch, which the chaos cluster trains


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _process_start(event: dict) -> float:
    return float(event.get("process_start") or event["ts"])


def costs_of(events: list[dict], kills: list[float], joins: list[float], full: int, every_steps: int,
             recovery=None) -> dict:  # type: ignore[no-untyped-def]
    """A run's costs in seconds, each as ``attribute`` would count it, from its events and the wall times its
    nodes were killed (``kills``) and started again (``joins``); medians where there are several:

    - ``step_s``: the step at full world, the mean (``step_s_by_world``: at each world seen);
    - ``commit_s``: training blocked per periodic save (a saved step's end to the next step's start);
    - ``upload_s``: a save's start to its commit (the ``seconds`` of ``checkpoint_committed``);
    - ``first_start_s``: the run's start: the first agent's start -> the resume plan of its first world
      (agents' imports, the first rendezvous, workers' start and load, the run's token store built);
      ``first_restart_s`` its part to the first worker's start, ``first_load_s`` the rest (as ``attribute``);
    - ``load_s``: a restarted worker's start to its resume plan (imports, model, process group, checkpoint);
    - ``kill_restart_s``: a SIGKILL -> the new world's worker start; ``detect_s`` and ``rendezvous_s`` its
      parts from ``recovery`` (bench/recovery.py's, of the survivor's agent log) where given;
    - ``join_boot_s``: a node started -> the survivors' last step (its agent starting and joining: they
      train on meanwhile);
    - ``join_restart_s``: that last step -> the next world's worker start (the survivors' commit and exit,
      the round with the new node, spawn); ``join_commit_s`` the commit on the way out, within it.
    """
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    saved = {e["step"] for e in events if e["event"] == "checkpoint_committed"}
    # A step's wall time as goodput counts it (the previous step's end to its end, the loop's own work between
    # included; not after a save), the mean: a loaded machine's slow steps count, as they do in the run.
    by_world: dict[int, list[float]] = {}
    world, before = 0, None
    for e in events:
        if e["event"] == "start":
            world, before = e["world"], None
        elif e["event"] == "step_done":
            if before is not None and before["step"] not in saved:
                by_world.setdefault(world, []).append(float(e["ts"]) - float(before["ts"]))
            before = e
    blocked, previous = [], None
    for e in events:
        if e["event"] == "start":
            previous = None
        elif e["event"] == "step_done":
            if previous is not None and previous["step"] in saved:
                blocked.append(float(e["ts"]) - float(e["seconds"]) - float(previous["ts"]))
            previous = e
    loads = []
    for i in starts[1:]:  # the first attempt also builds the run's token store: the run's start, not a restart's
        plan = next((e for e in events[i:] if e["event"] == "resume_plan"), None)
        if plan is not None:
            loads.append(float(plan["ts"]) - _process_start(events[i]))
    first = events[starts[0]]
    first_plan = float(next(e for e in events[starts[0]:] if e["event"] == "resume_plan")["ts"])
    kill_restarts = []
    for t in kills:
        i = next((i for i in starts if _process_start(events[i]) > t), None)
        if i is not None:
            kill_restarts.append(_process_start(events[i]) - t)
    boots, commits, join_restarts = [], [], []
    for t in joins:
        i = next((i for i in starts if events[i]["ts"] > t), None)
        if i is None or events[i - 1]["event"] not in ("preempted", "end"):
            continue  # the join's restart was merged with another change: no clean measure of it
        last_step = max((float(e["ts"]) for e in events[:i] if e["event"] == "step_done"), default=t)
        boots.append(last_step - t)
        commits.append(float(events[i - 1]["ts"]) - last_step)
        join_restarts.append(_process_start(events[i]) - last_step)
    uploads = [float(e["seconds"]) for e in events if e["event"] == "checkpoint_committed" and e.get("seconds")]
    kill_restart = _median(kill_restarts)
    detect = recovery.detect if recovery is not None and recovery.detect is not None else 0.0
    return {
        "step_s": statistics.mean(by_world.get(full) or [s for v in by_world.values() for s in v] or [0.0]),
        "step_s_by_world": {str(w): statistics.mean(v) for w, v in sorted(by_world.items())},
        "commit_s": _median(blocked), "upload_s": _median(uploads), "every_steps": every_steps,
        "first_start_s": first_plan - float(first.get("agent_start") or _process_start(first)),
        "first_restart_s": _process_start(first) - float(first.get("agent_start") or _process_start(first)),
        "first_load_s": first_plan - _process_start(first),
        "load_s": _median(loads),
        "kill_restart_s": kill_restart, "detect_s": min(detect, kill_restart),
        "rendezvous_s": kill_restart - min(detect, kill_restart),
        "kill_lost_steps": recovery.lost if recovery is not None else None,
        "join_boot_s": _median(boots), "join_commit_s": _median(commits), "join_restart_s": _median(join_restarts),
        "recovery_parts": dict(recovery.parts) if recovery is not None else None,
    }



def attempts_of(events: list[dict], t0: float) -> list[dict]:
    """The run's attempts, times from the replay's 0: worker start, resume plan (training begins), world, the
    step resumed from, the last step trained and how the attempt ended (its last event)."""
    out: list[dict] = []
    for e in events:
        if e["event"] == "start":
            out.append({"process_start": round(float(e.get("process_start") or e["ts"]) - t0, 2),
                        "world": e["world"], "trains": None, "resumed": None, "last_step": None})
        elif out:
            a = out[-1]
            if e["event"] == "resume_plan":
                a["trains"], a["resumed"] = round(float(e["ts"]) - t0, 2), e["step"]
            elif e["event"] == "step_done":
                a["last_step"] = e["step"]
            a["ended"], a["end"] = e["event"], round(float(e["ts"]) - t0, 2)
    return out



def model_costs(measured: dict, nodes: int) -> dict:
    """The goodput model's cost fields (bench/goodput_costs.py) from the calibration's measures, each split as
    ``elastic-ft goodput`` attributes it (restart: up to a worker's start; loading: to its resume plan).

    The model's nodes are alike (``gpus_per_node`` 1: a node is a rank of its batch plan); the cluster's
    differ in workers, so the step measured at full world is spread over the model's micro-batches at
    ``nodes`` ranks. No notices: the replay's removals are kills, so the leave fields are not used.
    """
    from elastic_ft.config import BatchConfig
    from elastic_ft.train.scaling import plan_batch

    batch = BatchConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, policy="constant_global")
    micro_steps = max(plan_batch(batch, 1.0, nodes).micro_steps)
    kill = measured["kill_restart_s"]
    return {
        "gpus_per_node": 1, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
        "every_steps": measured["every_steps"],
        "micro_step_s": measured["step_s"] / micro_steps, "step_sync_s": 0.0,
        "ckpt_block_s": measured["commit_s"], "ckpt_upload_s": measured["upload_s"],
        "commit_sync_s": measured["join_commit_s"],
        "detect_s": min(measured["detect_s"], kill), "rendezvous_s": kill - min(measured["detect_s"], kill),
        "worker_start_s": measured["load_s"], "load_s": 0.0,
        "join_rendezvous_s": max(0.0, measured["join_restart_s"] - measured["join_commit_s"]),
        "join_fetch_s": 0.0, "join_boot_s": measured["join_boot_s"],
        "initial_restart_s": measured["first_restart_s"], "initial_load_s": measured["first_load_s"],
    }
