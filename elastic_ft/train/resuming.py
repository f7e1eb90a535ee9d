"""The trainer's resume at a (re)start, and the step it keeps for the next one.

At a start the world decides (:mod:`~elastic_ft.train.peer_state`, a pure choice in
:mod:`~elastic_ft.train.resume_source`) between the newest step a node keeps in memory and the newest
committed checkpoint; from memory, the holder sends the state over the new group, the events of the steps
since the last commit are written again, and the step is committed at once in the background. At every
step end the keeping rank of each node hands the step to its keeper. Costs: a restart reads one manifest
listing and broadcasts the trainable state (grows with the adapters and optimizer state, not with the
frozen base, the data or the node count); a step copies the trainable state once on one rank per node.
"""

from __future__ import annotations

import dataclasses
import socket
from elastic_ft.train.restore import optimizer_tensors
from elastic_ft.train.resume import ResumePlan, plan_resume
from elastic_ft.train.resume_source import MEMORY


def resume(t) -> ResumePlan:  # t: the Trainer (elastic_ft.train.loop), which calls this
    """Resume from the newest step a node of this world keeps, when it is not older than the newest
    commit (:mod:`~elastic_ft.train.peer_state`; then committed again at once, asynchronously), else
    from the newest verified checkpoint the leader chooses (see :class:`Restorer`); plan from it.

    Raises :class:`RunAborted` on every rank when no decision can be made
    or any rank failed to load the chosen state.
    """
    source = t.peers.choose(t.store)
    if source.kind == MEMORY:
        loaded, held = t.peers.receive(source, t.restorer, model=t.model, trainable=t.trainable,
                                       optimizer=t.optimizer)
        source = dataclasses.replace(source, host=held.get("host"))
        skipped: list = []
        t.checkpoints.resumed(source.committed_step or 0)
    else:
        loaded, skipped = t.restorer.restore(
            spec_doc=t._spec_doc, model=t.model, trainable=t.trainable, optimizer=t.optimizer
        )
        if loaded is not None:
            t.checkpoints.resumed(loaded.manifest.step)
    if loaded is not None:
        t.step, t.cursor = loaded.manifest.step, loaded.manifest.cursor
        if t.evaluator is not None:  # its step's evaluation, if it finished before the save
            t.evaluator.resumed(loaded.manifest.eval, t.step)
    plan = plan_resume(
        loaded.manifest if loaded else None, skipped, plan=t.plan, config_hash=t._config_hash,
        total_steps=t.total_steps, origin=source,
    )
    if plan.from_memory and loaded is not None:
        _carry_events(t, loaded.documents.get("events") or [], plan.step, after=source.committed_step or 0)
    t.events.emit("resume_plan", **plan.event())
    if plan.rescale is not None:
        t.events.emit("rescale", **plan.rescale)
    if plan.from_memory and t.step > (source.committed_step or 0):
        # Committed now, in the background: a second loss before the next commit cannot take it.
        t.save("resumed from memory")
    return plan


def _carry_events(t, records: list, step: int, *, after: int) -> None:
    """Write again the events a kept step carried of the steps after the newest commit (``after``; its
    commit shipped the ones before) up to ``step``: the lost leader may have taken them unshipped. Marked
    ``carried``; the ledger's replay takes a step's samples once however often it is written."""
    for item in records:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in ("step_done", "step", "ledger")
                and isinstance(item[1], dict) and isinstance(item[1].get("step"), int)):
            continue
        trained = item[1]["step"] + (item[0] == "ledger")  # a ledger names its step from 0
        if after < trained <= step:
            fields = {k: v for k, v in item[1].items() if k not in ("ts", "event", "run_id", "attempt")}
            t.events.emit(item[0], quiet=True, carried=True, **fields)
            if t.metrics.each_step:  # uncommitted until the commit after the resume
                t.metrics.record(item[0], fields)


def keep_step(t) -> None:  # t: the Trainer, at the end of each step
    """Keep the step just completed in node-local memory (the keeping rank of each node; in the background)."""
    if t.peers.keeper is None:
        return
    if t._kept_fields is None:  # what does not change within an attempt, built once
        t._kept_fields = {
            "world": {"size": t.world.size, "host": socket.gethostname()},
            "rng": {"scheme": "reseed(seed, step, rank) before each step", "seed": t.spec.seed},
            "batch_plan": t.plan.to_dict(),
        }
    st = {"model": t.trainable, "optimizer": optimizer_tensors(t.optimizer, t.param_names)}
    t.peers.keep(step=t.step, cursor=t.cursor, tensors=st, manifest={
        **t._kept_fields,
        "scheduler": {"name": t.spec.optimizer.schedule, "step": t.step, "total_steps": t.total_steps,
                      "peak_lr": t.plan.lr},
    }, documents={"trainer": {"step": t.step, "cursor": t.cursor, "total_steps": t.total_steps},
                  "spec": t._spec_doc,
                  # The events of the steps since the last save: a leader lost with them unshipped would
                  # take them along; the new leader writes them again at a resume from this step.
                  "events": [[name, fields] for name, fields in t.metrics.records]})
