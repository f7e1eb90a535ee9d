"""The sample ledger: which samples the run's surviving history consumed.

With ``logging.ledger: true`` every step logs the (epoch, index) pairs each
rank processed. A restart rolls the model back to its checkpoint, so steps
logged after that checkpoint by the failed attempt no longer count: replaying
the events and cutting the history at each ``resume_plan`` gives the samples
the final model actually learned from, which must be every sample exactly once
per epoch, in the order the cursor defines.
"""

from __future__ import annotations

from elastic_ft.runevents.schema import valid


def replay(events: list[dict]) -> dict[int, list[tuple[int, int]]]:
    """step -> samples consumed at that step, as the final model saw them (malformed events left out:
    :mod:`~elastic_ft.runevents.schema`)."""
    history: dict[int, list[tuple[int, int]]] = {}
    for e in valid(events):
        if e.get("event") == "resume_plan":
            resumed = int(e["step"])
            for step in [s for s in history if s >= resumed]:
                del history[step]
        elif e.get("event") == "ledger":
            history[int(e["step"])] = [tuple(p) for per_rank in e["samples"] for p in per_rank]
    return dict(sorted(history.items()))


def check_exactly_once(history: dict[int, list[tuple[int, int]]], dataset_size: int) -> list[str]:
    """Problems with the replayed history (empty when every sample of each started
    epoch appears at most once, and every completed epoch holds each sample once)."""
    problems = []
    steps = sorted(history)
    if steps != list(range(len(steps))):
        missing = sorted(set(range(max(steps, default=-1) + 1)) - set(steps))
        problems.append(f"steps missing from the ledger: {missing[:10]}")
    seen: dict[int, set[int]] = {}
    for step in steps:
        for epoch, idx in history[step]:
            if idx in seen.setdefault(epoch, set()):
                problems.append(f"sample {idx} of epoch {epoch} consumed twice (again at step {step})")
            seen[epoch].add(idx)
    if seen:
        last = max(seen)
        for epoch in range(last):
            if len(seen.get(epoch, ())) != dataset_size:
                problems.append(f"epoch {epoch} consumed {len(seen.get(epoch, ()))} of {dataset_size} samples")
    return problems
