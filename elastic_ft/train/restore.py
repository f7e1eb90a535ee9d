"""Restoring a run from its newest checkpoint: the leader chooses, every rank loads, all or none.

What to resume from is decided by pure functions (:mod:`elastic_ft.train.resume`);
this module does the I/O and the collectives around them, so that any failure
stops every rank with its reason instead of leaving the others waiting in a
collective. Optimizer state is saved and loaded keyed by parameter *name*,
which is stable across restarts (parameter objects and their order are not).
A sharded checkpoint (an fsdp run's) loads through DCP into the current
world's state (:mod:`elastic_ft.train.dcp_state`); either strategy loads
either kind (:meth:`Restorer.load_into`).
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch

from elastic_ft.train import faults
from elastic_ft.checkpoint.manifest import ManifestError
from elastic_ft.checkpoint.reader import LoadedCheckpoint, Skipped, load_blobs, load_newest, read_manifest
from elastic_ft.checkpoint.store import StoreError
from elastic_ft.checkpoint.writer import retire
from elastic_ft.runevents.events import EventLog
from elastic_ft.checkpoint import sharded
from elastic_ft.train import dcp_state, sharding
from elastic_ft.train import model as model_mod
from elastic_ft.train.resume import incompatible_spec, shape_mismatches
from elastic_ft.train.world import RunAborted, World, broadcast_from_leader, gather_from_all, settle

if TYPE_CHECKING:
    from elastic_ft.checkpoint.store import ObjectStore

log = logging.getLogger("elastic_ft.train.loop")  # the name these log lines always had
# How long a rank that stops waits for the others to have logged why (see Restorer.abort).
ABORT_SETTLE = timedelta(seconds=10)


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state keyed by parameter *name* (stable across restarts)."""
    out = {}
    for param, state in optimizer.state.items():
        for k, v in state.items():
            out[f"{names[param]}::{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, params: dict, tensors: dict) -> None:
    """Put :func:`optimizer_tensors`' output back; raises ValueError naming a parameter this model lacks.

    Through torch's own ``load_state_dict`` (its state keyed by the parameters' positions, mapped here from
    their names): torch then places each value by its rules, states in the parameter's dtype and device and
    ``step`` on the host unless the optimizer is fused or capturable. A ``step`` put on a GPU for a plain
    AdamW would cost a host sync per parameter per step (it reads ``step.item()``).
    """
    position = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("::")
        if name not in params:
            raise ValueError(f"checkpoint optimizer state names parameter {name!r}, which this model does not train")
        state.setdefault(position[id(params[name])], {})[field] = value
    full = optimizer.state_dict()
    full["state"] = state
    optimizer.load_state_dict(full)


@dataclasses.dataclass(kw_only=True)
class Restorer:
    """What restoring needs from the run: where its checkpoints are, this rank, and where events go."""

    world: World
    store: ObjectStore
    run_id: str
    events: EventLog
    injector: faults.Injector

    def restore(self, *, spec_doc: dict, model: torch.nn.Module, trainable: dict,
                optimizer: torch.optim.Optimizer) -> tuple[LoadedCheckpoint | None, list[Skipped]]:
        """Load the newest verified checkpoint the leader chooses; every rank loads the same one.

        Returns (the loaded checkpoint, or None for a fresh run; the corrupt
        ones skipped). The leader chooses (:meth:`choose`) and tells every
        rank; then every rank loads and reports success or failure in one
        collective (:meth:`load_on_every_rank`). Raises :class:`RunAborted` on
        every rank when no decision can be made or any rank failed to load.
        """
        decision, loaded = (None, None)
        if self.world.is_leader:
            decision, loaded = self.choose(spec_doc)
        status, detail, skipped = broadcast_from_leader(self.world, decision)
        if status == "error":
            self.abort(f"cannot resume run {self.run_id!r}: {detail}")
        if detail is not None:
            loaded = self.load_on_every_rank(detail, loaded, model=model, trainable=trainable, optimizer=optimizer)
        return loaded, skipped

    def choose(self, spec_doc: dict) -> tuple[tuple, LoadedCheckpoint | None]:
        """Leader: ((status, manifest key or error, corrupt ones retired), the loaded checkpoint).

        Corrupt checkpoints newer than the chosen one are retired to quarantine/,
        and only once the choice is final: an unreadable or foreign checkpoint,
        or a spec that cannot load the chosen one, stops the run with nothing moved.
        """
        try:
            loaded, skipped = load_newest(self.store, self.run_id)
            if loaded is not None:
                why = incompatible_spec(loaded.documents.get("spec"), spec_doc, step=loaded.manifest.step,
                                        run_id=self.run_id)
                if why is not None:
                    return ("error", why, []), None
            for s in skipped:
                retire(self.store, s.key, s.reason)
        except Exception as exc:  # every rank must stop, not hang
            return ("error", describe_error(exc), []), None
        return ("ok", loaded.manifest.key if loaded else None, skipped), loaded

    def load_on_every_rank(self, key: str, loaded: LoadedCheckpoint | None, *, model: torch.nn.Module,
                           trainable: dict, optimizer: torch.optim.Optimizer) -> LoadedCheckpoint:
        """Every rank loads ``key`` (the leader already holds it) into its model and optimizer; all or none.

        A collective gathers each rank's result after fetching and again after
        loading (a sharded load is itself collective: no rank enters it alone);
        any failure raises :class:`RunAborted` on every rank, naming the ranks
        and their reasons.
        """
        error = None
        try:
            if loaded is None:
                self.injector.maybe_fail_load(rank=self.world.rank)
                manifest = read_manifest(self.store, key, run_id=self.run_id)
                # A sharded checkpoint: each rank reads only what its shards need, in load_into.
                loaded = (LoadedCheckpoint(manifest, {}, {}) if sharded.is_sharded(manifest)
                          else load_blobs(self.store, manifest))
        except Exception as exc:  # reported to every rank below
            error = f"rank {self.world.rank}: {describe_error(exc)}"
        self._all_or_none(error, key)
        assert loaded is not None
        try:
            self.load_into(loaded, model=model, trainable=trainable, optimizer=optimizer)
        except Exception as exc:
            error = f"rank {self.world.rank}: {describe_error(exc)}"
        self._all_or_none(error, key)
        return loaded

    def _all_or_none(self, error: str | None, key: str) -> None:
        """Every rank's ``error`` gathered; :meth:`abort` on every rank, naming each failure, if any."""
        failed = [e for e in gather_from_all(self.world, error) if e is not None]
        if failed:
            where = self.store.join(key)
            self.abort(f"cannot resume run {self.run_id!r} from {where}: {'; '.join(failed)}")

    def load_into(self, loaded: LoadedCheckpoint, *, model: torch.nn.Module, trainable: dict,
                  optimizer: torch.optim.Optimizer) -> None:
        """Put a checkpoint's trainable state into this rank's model and optimizer, whichever strategy wrote it.

        A sharded checkpoint (fsdp) loads through DCP into the current world's state, resharded (or whole, for
        a ddp run); a replicated one (ddp) is copied in, or distributed over the shards of an fsdp model.
        """
        if sharded.is_sharded(loaded.manifest):
            state = dcp_state.template(model, optimizer)
            sharded.load_sharded(self.store, loaded.manifest, state)  # collective, on the training group
            dcp_state.apply(model, optimizer, state)
            return
        bad = shape_mismatches({n: tuple(t.shape) for n, t in loaded.tensors["model"].items()},
                               {n: tuple(p.shape) for n, p in trainable.items()})
        if bad:  # e.g. another base model under model.name_or_path
            raise ValueError(f"the checkpoint's {len(bad)} trained tensor(s) do not fit this model ({bad[0]}): "
                             f"the model changed since; start a new run with another --run_id")
        if sharding.is_sharded(model):
            model_mod.check_trainable_names(model, loaded.tensors["model"])
            dcp_state.apply(model, optimizer, loaded.tensors, full=True)
            return
        model_mod.load_trainable_state(model, loaded.tensors["model"])
        load_optimizer_tensors(optimizer, trainable, loaded.tensors["optimizer"])

    def abort(self, reason: str) -> NoReturn:
        """Record ``reason`` now, on every rank, then raise :class:`RunAborted` with it.

        Now, not on the way out, and every rank waits (bounded) until all have
        logged: once the first rank exits, torchrun stops the others, which may
        not have printed their error yet.
        """
        self.events.emit("resume_failed", quiet=True, reason=reason)
        log.error("rank %d: %s", self.world.rank, reason)
        settle(self.world, ABORT_SETTLE)
        raise RunAborted(reason)


def describe_error(exc: BaseException) -> str:
    """One line for an error: domain errors speak for themselves; others say what they are."""
    if isinstance(exc, (StoreError, ManifestError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
