"""How the ranks of a token store build agree, step by step (:mod:`elastic_ft.train.token_build`).

Each step that one rank can fail alone ends in one exchange where every rank reports how it went, so no rank
waits in a later collective for a rank that gave up. The exchanges run on a gloo group of their own whose
timeout follows the data's size: the leader's assembly and upload, and each node's fetch and hash, happen
while the others wait in them. Cost: one exchange of a few bytes per rank per step, and one group made per
start (grows with the world only).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist

from elastic_ft.train.datafiles import DataError
from elastic_ft.train.world import RunAborted, World, broadcast_from_leader, gather_from_all


def _line(exc: BaseException) -> str:
    """An exception as the one line the other ranks print."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, DataError) else f"{type(exc).__name__}: {text}"


def together(world: World, what: str, fn, *, leader_only: bool = False, group=None):
    """``fn()`` on every rank (or the leader only, its value broadcast), and every rank learns of any rank's
    failure: the rank that failed raises its own exception, every other one :class:`RunAborted` naming it.
    So no rank waits in a later collective for a rank that gave up; a rank that dies instead is waited
    for at most the process group's collective timeout (``group``'s: :func:`exchange_group`; torchrun stops a
    node's ranks when one dies)."""
    mine: BaseException | None = None
    value = None
    if world.is_leader or not leader_only:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised here as it was
            mine = exc
    report = (None if mine is None else _line(mine), value)
    if leader_only:
        reports = [broadcast_from_leader(world, report, group)]
        ranks = [0]
    else:
        reports = gather_from_all(world, report, group)
        ranks = list(range(len(reports)))
    failed = [(rank, line) for rank, (line, _) in zip(ranks, reports) if line is not None]
    if mine is not None:
        raise mine
    if failed:
        rank, line = failed[0]
        raise RunAborted(f"the token store's {what} failed on rank {rank}: {line}")
    return reports[0][1] if leader_only else [v for _, v in reports]


TRANSFER_BYTES_PER_S = 20e6
"""A conservative rate for the token store's dataset-sized work (tokenizing, uploading the parts, the leader
downloading them and uploading the store, a node fetching and hashing it): a slow link's, well under what a
rank tokenizes (the bench: about 2.5 MB of JSON Lines per CPU second) or a cloud link moves."""
WORK_PER_INPUT_BYTE = 10
"""Bytes of that work per byte of input data: the store is about 3 bytes per token (uint16 ids and a byte of
trained mark; at most 5 with 32-bit ids), a token at least a byte of text, and the build moves the store
about twice (parts up and down, the store up) before a node fetches and hashes it."""
MAX_EXCHANGE_TIMEOUT_S = 86400.0
"""The longest the token store's exchanges wait for a rank (spot.collective_timeout_s's own bound)."""


def exchange_timeout(input_bytes: int, floor_s: float) -> float:
    """Seconds the token store's exchanges wait for a rank: ``floor_s`` (the collective timeout) plus the
    dataset-sized work at :data:`TRANSFER_BYTES_PER_S`, at most :data:`MAX_EXCHANGE_TIMEOUT_S`.

    Why not the collective timeout alone: the leader's assembly and upload, and each node's fetch and hash,
    happen while the other ranks wait in the exchange; at tens of GB on a slow link that outlasts any fixed
    bound, and each new world would start the work again. A rank that dies is still noticed sooner (torchrun
    stops a node's ranks when one dies; a lost node ends the rendezvous)."""
    work = max(0, input_bytes) * WORK_PER_INPUT_BYTE
    return min(MAX_EXCHANGE_TIMEOUT_S, max(0.0, floor_s) + work / TRANSFER_BYTES_PER_S)


@contextlib.contextmanager
def exchange_group(world: World, input_bytes: int):
    """A gloo group of every rank for the token store's exchanges, its timeout from :func:`exchange_timeout`
    (None on a single process). Made by every rank at every start (one exchange through the group's store)."""
    if not world.distributed:
        yield None
        return
    floor = world.collective_timeout.total_seconds() if world.collective_timeout else 600.0
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=exchange_timeout(input_bytes, floor)))
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


__all__ = ["MAX_EXCHANGE_TIMEOUT_S", "TRANSFER_BYTES_PER_S", "WORK_PER_INPUT_BYTE", "exchange_group",
           "exchange_timeout", "together"]
