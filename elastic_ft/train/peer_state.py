"""Resuming from a surviving node's kept step: report what each node holds, decide, send it to every rank.

The restart side of :mod:`elastic_ft.train.kept_state`. At a (re)start every rank
reports what its node keeps (local rank 0 reads and verifies its node's file; the
others report nothing) in one all-gather of :data:`~elastic_ft.train.resume_source.REPORT_WIDTH`
int64 per rank on the group's device; the leader reads the newest committed step
(one listing of the store's manifests, no blob) and decides
(:func:`~elastic_ft.train.resume_source.choose_source`), and tells every rank. For a
memory source the holder broadcasts its sidecar (JSON, as a uint8 tensor) and the
state's safetensors bytes over the new process group, and every rank loads them
exactly as a checkpoint load would (:meth:`Restorer.load_into`), all or none. A
joining node then reads no state from the store.

Cost of a restart: one read of the node's kept file on each local rank 0 (the
trainable state's size), one small all-gather, one listing by the leader, and a
broadcast of the trainable state (its size, on the group's transport), whatever
the dataset or the frozen base. On a GPU the received bytes are copied to the
host to be parsed, then to the device by the load: twice the trainable state's
size in transfers, once in device memory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from elastic_ft.checkpoint.manifest import Manifest, step_of_key
from elastic_ft.checkpoint.reader import LoadedCheckpoint, list_manifests
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.runevents.events import EventLog
from elastic_ft.train import kept_files, kept_state
from elastic_ft.train.kept_state import KeptState, Keeper
from elastic_ft.train.restore import Restorer, describe_error
from elastic_ft.train.resume_source import (
    MEMORY, REPORT_WIDTH, Held, ResumeSource, choose_source, decode, encode,
)
from elastic_ft.train.world import World, broadcast_from_leader, gather_from_all

log = logging.getLogger(__name__)

SHM_SHARE = 0.5
"""The share of the kept-state directory's free space (node memory, for ``/dev/shm``) two slots may take."""


def under_agent() -> bool:
    """Whether a torchrun agent started this worker (and restarts it on a membership change)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class PeerState:
    """This rank's side of keeping steps and resuming from them (see the module); :meth:`close` ends it."""

    def __init__(self, world: World, *, run_id: str, config_hash: str, enabled: bool, strategy: str,
                 directory: str | None = None, events: EventLog | None = None) -> None:
        self.world, self.run_id, self.config_hash, self.events = world, run_id, config_hash, events
        self._sized = False
        self.enabled, self.strategy = enabled, strategy
        # Every rank of a job has the same spec and launcher: all agree on whether the exchange happens.
        self.active = enabled and strategy != "fsdp" and under_agent()
        self.directory = self.name = None
        self.keeper: Keeper | None = None
        self.held: KeptState | None = None
        self.identity = kept_files.identity_of(run_id, config_hash)
        if self.active and world.local_rank == 0:
            try:
                self.directory = kept_files.kept_dir(directory)
                kept_files.remove_orphans(self.directory)
                self.name = kept_files.kept_name(run_id, kept_files.agent_id())
                self.keeper = Keeper(self.directory, self.name)
            except (OSError, kept_files.KeptStateError) as exc:  # this node keeps nothing; the run goes on
                log.warning("this node keeps no step in memory: %s", exc)
                self.directory = self.name = None
        self._static = {"run_id": run_id, "config_hash": config_hash, "host": socket.gethostname(),
                        "agent": kept_files.agent_id()}

    # ------------------------------------------------------------------ steps

    def keep(self, *, step: int, cursor: int, tensors: dict[str, dict[str, torch.Tensor]], manifest: dict,
             documents: dict) -> None:
        """The keeping rank: keep ``step``'s state (host tensors by group); a no-op on every other rank."""
        if self.keeper is None:
            return
        if not self._sized:
            self._sized = True
            why = self.room_for(tensors)
            if why is not None:  # e.g. a full fine-tune's state: this node resumes from commits only
                log.warning("this node keeps no step in memory: %s", why)
                if self.events is not None:
                    self.events.emit("kept_state_off", reason=why)
                self.keeper.close(discard_files=True)
                self.keeper = None
                return
        try:
            self.keeper.keep(tensors, {**self._static, "step": step, "cursor": cursor, "created": time.time(),
                                       **manifest, "documents": documents})
        except (OSError, kept_files.KeptStateError) as exc:  # e.g. shared memory full: training goes on
            why = f"keeping step {step} failed: {exc}; a lost node costs the steps since the last commit"
            log.warning("this node keeps no step in memory from now on: %s", why)
            if self.events is not None:
                self.events.emit("kept_state_off", reason=why)
            self.keeper.close(discard_files=True)
            self.keeper = None

    def room_for(self, tensors: dict[str, dict[str, torch.Tensor]]) -> str | None:
        """None if two slots of ``tensors`` fit in the kept-state directory's free space with half of it to spare
        (it is memory: the training needs the rest); else why not."""
        need = 2 * sum(t.numel() * t.element_size() for d in tensors.values() for t in d.values())
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if need > free * SHM_SHARE:
            return (f"two copies of the trainable state ({need / 2**30:.2f} GiB) exceed {SHM_SHARE:.0%} of the free "
                    f"space in {self.directory} ({free / 2**30:.2f} GiB): a lost node costs the steps since the "
                    f"last commit")
        return None

    def close(self, *, ended: bool) -> None:
        """Finish the write in flight; ``ended`` (the run ended normally): remove this node's files."""
        if self.keeper is not None:
            self.keeper.close(discard_files=ended)
            self.keeper = None

    # ------------------------------------------------------------------ restart

    def report(self) -> Held | None:
        """What this rank's node holds (local rank 0 reads and verifies the file; other ranks: None)."""
        if self.directory is None or self.name is None:
            return None
        held, why = kept_state.read_kept(self.directory, self.name, run_id=None, config_hash=None)
        log.info("kept state on this node: %s", why)
        self.held = held
        if held is None:
            return None
        return Held(held.step, held.identity, int(os.environ.get("GROUP_RANK", "0")))

    def choose(self, store: ObjectStore) -> ResumeSource:
        """The new world's resume source, the same on every rank (collective when active)."""
        if not self.active:
            reason = ("not started by a torchrun agent: no worker restart to keep a step for" if not under_agent()
                      and self.enabled and self.strategy != "fsdp" else None)
            source = choose_source([], committed_step=None, identity=self.identity, enabled=self.enabled,
                                   strategy=self.strategy)
            return source if reason is None else ResumeSource(source.kind, reason)
        row = torch.tensor(encode(self.report()), dtype=torch.int64, device=self.world.device)
        reports = [decode(r.tolist()) for r in _all_gather_rows(self.world, row)]
        source = None
        if self.world.is_leader:
            committed, note = newest_committed_step(store)
            source = choose_source(reports, committed_step=committed, identity=self.identity)
            if note:
                source = ResumeSource(source.kind, f"{source.reason} ({note})", source.rank, source.node,
                                      source.step, source.committed_step)
        return broadcast_from_leader(self.world, source)

    def receive(self, source: ResumeSource, restorer: Restorer, *, model: torch.nn.Module, trainable: dict,
                optimizer: torch.optim.Optimizer) -> tuple[LoadedCheckpoint, dict]:
        """Every rank: the holder's state, broadcast over the group and loaded into this rank's model and
        optimizer, all or none (:class:`RunAborted` on every rank naming each failure); and the holder's sidecar."""
        assert source.kind == MEMORY and source.rank is not None
        w = self.world
        error = None
        meta_bytes = data = b""
        if w.rank == source.rank:
            held = self.held
            if held is None or held.step != source.step:  # the decision was made from this rank's report
                error = f"rank {w.rank}: its kept step changed since it reported it"
            else:
                meta_bytes, data = json.dumps(held.meta).encode(), held.data
        sizes = torch.tensor([len(meta_bytes), len(data), error is not None], dtype=torch.int64, device=w.device)
        _broadcast(w, sizes, source.rank)
        if int(sizes[2]):
            self._fail(restorer, error or f"rank {source.rank}: its kept state went away", source)
        meta_t = _bytes_tensor(meta_bytes, int(sizes[0]), w.device)
        data_t = _bytes_tensor(data, int(sizes[1]), w.device)
        _broadcast(w, meta_t, source.rank)
        _broadcast(w, data_t, source.rank)
        loaded = None
        try:
            meta = json.loads(bytes(meta_t.cpu().numpy()))
            received = KeptState(meta, bytearray(data_t.cpu().numpy().tobytes()) if data_t.is_cuda
                                 else _writable(data_t))
            loaded = LoadedCheckpoint(manifest_of(meta), received.tensors(), dict(meta.get("documents") or {}))
            restorer.load_into(loaded, model=model, trainable=trainable, optimizer=optimizer)
        except Exception as exc:
            error = f"rank {w.rank}: {describe_error(exc)}"
        failed = [e for e in gather_from_all(w, error) if e is not None]
        if failed:
            self._fail(restorer, "; ".join(failed), source)
        assert loaded is not None
        return loaded, meta

    def _fail(self, restorer: Restorer, why: str, source: ResumeSource):
        restorer.abort(f"cannot resume run {self.run_id!r} from step {source.step} kept by node {source.node}: "
                       f"{why}. A restarted job resumes from the newest committed checkpoint")


def newest_committed_step(store: ObjectStore) -> tuple[int | None, str]:
    """The newest manifest's step (None: none) from one listing, and a note when the store could not be listed
    (then None: the kept step is weighed against nothing, and committed again right after the resume)."""
    try:
        steps = [s for s in (step_of_key(i.key) for i in list_manifests(store)) if s is not None]
    except Exception as exc:  # a store that does not answer: the kept step does not need it
        return None, f"the store's manifests could not be listed: {describe_error(exc)}"
    return (max(steps) if steps else None), ""


def manifest_of(meta: dict) -> Manifest:
    """A manifest-shaped record of a kept state (no blobs): what the resume plan reads of a checkpoint."""
    return Manifest(run_id=meta["run_id"], step=int(meta["step"]), cursor=int(meta["cursor"]),
                    created=float(meta.get("created") or 0.0), writer=f"memory:{meta.get('host')}:{meta.get('agent')}",
                    config_hash=meta["config_hash"], blobs={}, world=dict(meta.get("world") or {}),
                    rng=dict(meta.get("rng") or {}), scheduler=dict(meta.get("scheduler") or {}),
                    batch_plan=dict(meta.get("batch_plan") or {}), eval={})


def _all_gather_rows(world: World, row: torch.Tensor) -> list[torch.Tensor]:
    if not world.distributed:
        return [row]
    out = [torch.empty(REPORT_WIDTH, dtype=torch.int64, device=world.device) for _ in range(world.size)]
    dist.all_gather(out, row)
    return out


def _broadcast(world: World, t: torch.Tensor, src: int) -> None:
    if world.distributed and t.numel():
        dist.broadcast(t, src=src)


def _bytes_tensor(data: bytes | bytearray, size: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``size`` bytes on ``device``: ``data`` on the sender, uninitialised on the others."""
    if data:
        return torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8).to(device)
    return torch.empty(size, dtype=torch.uint8, device=device)


def _writable(t: torch.Tensor) -> memoryview:
    """A host uint8 tensor's memory as a writable view (the loaded tensors are views of it: no copy)."""
    return memoryview(t.numpy())
