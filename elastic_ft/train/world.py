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
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout


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
    """A :func:`settle` timed out: a peer is gone or stuck, and tearing the process group down could wait
    for it, so the group is left to :func:`exit_process`."""
    store: dist.Store | None = None
    """The process group's key-value store (its TCPStore, under a prefix of ours), for :func:`settle`; None
    without a process group, or for one that :func:`init_world` did not make."""
    collective_timeout: timedelta | None = None
    """The bound :func:`init_world` gave the default group's collectives (None: torch's default); groups made
    for longer exchanges (the token store's build and fetch) scale it."""
    settles: int = 0
    """:func:`settle` calls so far (every rank makes the same ones: each meets under its own key)."""

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def from_leader(self, value):
        """:func:`broadcast_from_leader` as a method, for the layers below train that are handed a world."""
        return broadcast_from_leader(self, value)


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
    store = None
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # The store, made as init_process_group makes it for env:// (torchrun's variables; a new one at
        # every restart), kept so that settle() can meet on it; the group's keys go under its usual prefix.
        timeout = collective_timeout or (default_pg_nccl_timeout if backend == "nccl" else default_pg_timeout)
        base, _, _ = next(dist.rendezvous("env://", rank, size, timeout=timeout))
        base.set_timeout(timeout)
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", base), rank=rank, world_size=size,
                                timeout=collective_timeout)
        store = dist.PrefixStore("elastic_ft/settle", base)
    return World(rank, size, local_rank, local_size, device, store=store, collective_timeout=collective_timeout)


def broadcast_from_leader(world: World, value, group=None):
    """``value`` as the leader has it, on every rank (a Python object through the process group, or through
    ``group``: a gloo group of every rank, on the host)."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group, device=world.device if group is None else torch.device("cpu"))
    return box[0]


def gather_from_all(world: World, value, group=None) -> list:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` on a single process); through
    ``group`` (a gloo group of every rank) if given."""
    if not world.distributed:
        return [value]
    out = [None] * world.size
    # all_gather_object has no device argument: NCCL uses the current CUDA device, which init_world set
    # (a gloo group's objects stay on the host).
    dist.all_gather_object(out, value, group=group)
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

    The ranks meet on the process group's store, not in a collective, because
    only the store's wait is bounded alike on both backends. On gloo,
    ``barrier(async_op=True).wait(timeout)`` raises once ``timeout`` passes,
    its barrier left queued. On NCCL (``ProcessGroupNCCL::WorkNCCL::wait`` and
    its watchdog as torch's sources read for 2.13; not run here, no GPU), an
    explicit timeout makes ``wait`` poll the work from the CPU (so it is
    bounded without ``TORCH_NCCL_BLOCKING_WAIT``), but when it expires it aborts the
    communicator and marks the work failed, and the group's watchdog then takes
    the process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, the default: a
    SIGABRT in place of the exit code the caller is about to choose). Setting
    ``TORCH_NCCL_BLOCKING_WAIT=1`` instead would make every collective's wait a
    host sync, and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` values that keep the
    process let a rank go on after a failed collective with what it left in its
    tensors. The store (the TCPStore torchrun's variables name) takes a timeout
    for every operation on every backend, and a timed-out wait leaves nothing
    queued on the process group. Cost: two store operations per rank.
    """
    if not world.distributed:
        return True
    if world.store is None:
        raise RuntimeError("settle() waits on the store of a process group that init_world() made")
    world.settles += 1
    key = str(world.settles)
    before = world.store.timeout
    world.store.set_timeout(timeout)  # also bounds add(): a store host gone silent answers nothing
    try:
        if world.store.add(key, 1) == world.size:  # the last to come lets every rank go
            world.store.set(f"{key}/all", "1")
        world.store.wait([f"{key}/all"], timeout)
    except RuntimeError:  # DistStoreError (a timeout), or the store's host gone
        world.barrier_pending = True
        return False
    finally:
        try:
            world.store.set_timeout(before)
        except RuntimeError:  # pragma: no cover - a store that is gone keeps no timeout to restore
            pass
    return True


def close_world(world: World) -> None:
    """Leave the process group. After a :func:`settle` that timed out, a peer is gone or stuck and
    ``destroy_process_group`` could wait for it (until the peer exits, or the group's timeout): then
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
