"""The world of one training process: its rank, the process group, and the collectives the trainer uses.

Every collective here is a no-op on a single process (no torchrun), so the
trainer reads the same with one rank or many.

The default group is NCCL on GPU hosts and gloo otherwise, and NCCL takes only
CUDA tensors: every tensor handed to it is on ``World.device`` (the rule
tests/unit/test_collective_devices.py checks around the real step), and object
collectives name that device rather than rely on ``torch.cuda.set_device``.
(Background saves use a gloo group of their own, with host tensors.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist


class RunAborted(RuntimeError):
    """Raised on every rank when one rank hit an error that all must stop for."""


@dataclasses.dataclass
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    barrier_pending: bool = False
    """A :func:`settle` barrier timed out and is still queued on the process group."""

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def init_world(collective_timeout: timedelta | None = None) -> World:
    """Join the process group when launched by torchrun; a single process otherwise.

    ``collective_timeout`` bounds the group's start (waiting for every rank's
    store keys) and each collective; None is torch's default (30 minutes for
    gloo, 10 for NCCL). A peer gone silent then fails the wait in bounded time.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Several ranks share this host's cores: oversubscribed threads make every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=collective_timeout)
    return World(rank, size, local_rank, local_size, device)


def broadcast_from_leader(world: World, value):
    """``value`` as the leader has it, on every rank (a Python object through the process group)."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=world.device)
    return box[0]


def gather_from_all(world: World, value) -> list:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` on a single process)."""
    if not world.distributed:
        return [value]
    out = [None] * world.size
    # all_gather_object has no device argument: NCCL uses the current CUDA device, which init_world set.
    dist.all_gather_object(out, value)
    return out


def sum_over_ranks(world: World, t: torch.Tensor) -> None:
    """All-reduce ``t`` in place: directly when it is on the world's device, else through it (NCCL
    reduces no host memory)."""
    if not world.distributed:
        return
    if t.device == world.device:
        dist.all_reduce(t)
        return
    on_device = t.to(world.device)
    dist.all_reduce(on_device)
    t.copy_(on_device)


def settle(world: World, timeout: timedelta) -> bool:
    """Wait until every rank reaches this call, or ``timeout`` passes; True if all came.

    For the way out of a run every rank leaves alike: once the first rank
    exits, torchrun stops the others, which may not have printed their reason
    yet. Bounded, so a rank that never comes costs ``timeout``, not a hang.
    """
    if not world.distributed:
        return True
    try:
        dist.barrier(async_op=True).wait(timeout=timeout)
    except RuntimeError:  # gloo's "Operation timed out!", or a peer gone
        world.barrier_pending = True
        return False
    return True


def close_world(world: World) -> None:
    """Leave the process group. After a :func:`settle` that timed out, its barrier is still queued and
    ``destroy_process_group`` would wait for it (until the peer exits, or the group's timeout): then
    the group is left to :func:`exit_process`."""
    if world.distributed and not world.barrier_pending:
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` once logs and output are flushed: ``os._exit``, never the interpreter's
    finalization. Callers close their files and their world first (the trainer's close, :func:`close_world`).

    Why not ``sys.exit``: gloo's worker threads outlive :func:`close_world` (``destroy_process_group``
    only unregisters a group that a DDP or FSDP module, a DTensor or a device mesh still holds), and
    one of them drops each collective's work, and its tensors, just after the collective completes.
    A tensor a Python object still refers to then takes the GIL to release it; once the interpreter
    is finalizing, that thread is ended by ``pthread_exit`` inside a C++ destructor and the process
    aborts: "terminate called without an active exception", SIGABRT (code 134) instead of ``code``.
    A loaded host widens that window from microseconds to milliseconds. Finalization also waits for a
    :func:`settle` barrier still queued, and costs about 1.3 s on 2 cores with torch, transformers and
    peft loaded, which every node waits out after a notice (the agent restarts a node's workers, and
    a leaving node's agent leaves the rendezvous, only once they have exited).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
