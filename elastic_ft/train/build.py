"""Building a trainer's parts: one small step each, given what it needs (torchtitan's ``build_*``).

A step that opens something to close (the store's connections, the events file and its sinks, the
checkpoint group and the saver's thread, the spot watcher and the SIGTERM handler) registers its close
on the ``resources`` stack it is given: a later step that fails then closes everything opened before
it, last first, and the run's end closes them the same way (:meth:`elastic_ft.train.loop.Trainer.close`).
Each close learns through the stack whether the run ends on an error (:func:`ends_on_error`): the
saver then gives its save in flight up rather than wait for it.

Cost: opening the store and the events is a collective or two (the attempt number); the model and
data load grow with the model and the dataset (the token store is memory-mapped, not read); the rest
is constant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable

from elastic_ft.checkpoint.cache import CachedStore
from elastic_ft.checkpoint.lease import WriterLease
from elastic_ft.checkpoint.store import ObjectStore, join_uri, open_store
from elastic_ft.config import JobSpec
from elastic_ft.inputs.resolve import InputSource
from elastic_ft.runevents.events import EventLog
from elastic_ft.runevents.shipper import Shipper, open_run_events
from elastic_ft.train import data as data_mod
from elastic_ft.train import model as model_mod
from elastic_ft.train import precision, run_lease, sharding
from elastic_ft.train.evaluation import Evaluator
from elastic_ft.train.preemption import Preempted, Preemption
from elastic_ft.train.saving import Checkpoints
from elastic_ft.train.world import World
from elastic_ft.viz.tensorboard import TensorBoardSink


def ends_on_error(exc: BaseException | None) -> bool:
    """Whether a run that ends on ``exc`` ends on an error: any exception but :class:`Preempted`, which
    is raised only after the state was committed (closing then waits for the saves, as at the end)."""
    return exc is not None and not isinstance(exc, Preempted)


def build_store(spec: JobSpec, checkpoint_uri: str, run_id: str, resources: contextlib.ExitStack) -> ObjectStore:
    """The run's location in the checkpoint store (its connections closed last)."""
    store = open_store(join_uri(checkpoint_uri, run_id), spec.checkpoint.store_settings())
    resources.callback(store.close)
    return store


def build_lease(world: World, store: ObjectStore, run_id: str, resources: contextlib.ExitStack) -> WriterLease | None:
    """The run's writer lease (:mod:`elastic_ft.train.run_lease`): a second live job on this run is
    refused here, before it writes anything. Released after the checkpoints close (no commit follows),
    also when a later step fails: a retry in this process must not wait for it to expire."""
    lease = run_lease.hold(world, store, run_id)
    if lease is not None:
        resources.callback(lease.release)
    return lease


def commit_checks(lease: WriterLease | None, shipper: Shipper | None) -> Callable[[Any], None]:
    """The leader's checks between a checkpoint's blobs and its manifest: still the run's writer (else
    :class:`~elastic_ft.checkpoint.lease.LeaseLost`, which stops the run), then the events shipped."""

    def check(snap: Any) -> None:
        if lease is not None:
            lease.check()
        if shipper is not None:
            shipper.before_commit(snap)

    return check


def build_events(spec: JobSpec, world: World, store: ObjectStore, log_dir: str, run_id: str,
                 resources: contextlib.ExitStack, *, node_head: bool) -> tuple[EventLog, Shipper | None]:
    """The leader's events.jsonl, and its shipper to the store's events/ (see :mod:`elastic_ft.runevents`);
    TensorBoard's sink where the spec asks for it. Closing the log closes its sinks (the shipper's last
    shipment says how this attempt stopped)."""
    events, shipper = open_run_events(world, store, os.path.join(log_dir, "events.jsonl"), node_head=node_head,
                                      run_id=run_id)
    resources.callback(events.close)
    if spec.logging.tensorboard and world.is_leader:
        events.add_sink(TensorBoardSink(os.path.join(log_dir, "tensorboard")))
    return events, shipper


def build_cached_store(spec: JobSpec, store: ObjectStore, run_id: str) -> ObjectStore:
    """``store`` behind this node's checkpoint cache when ``checkpoint.local_cache_dir`` is set (closing
    it closes ``store``, which :func:`build_store` registered)."""
    if spec.checkpoint.local_cache_dir is None:
        return store
    return CachedStore(store, os.path.join(spec.checkpoint.local_cache_dir, run_id))


def build_model_and_data(spec: JobSpec, world: World, store: ObjectStore,
                         run_id: str) -> tuple[Any, Any, data_mod.TokenStore]:
    """(tokenizer, model on this rank's device, the dataset); ``s3://`` inputs through this node's cache.

    The dataset is the run's token store: tokenized once per run (by this world if ``store`` has none
    committed yet) and mapped from the node's disk, so a restart's cost does not grow with the data."""
    load_to = sharding.load_device(spec.parallelism, world.device, world.distributed,
                                   quantized=spec.quantization.load_in_4bit)
    with InputSource.from_spec(spec) as inputs:  # s3:// model and data: this node's cached copies
        tokenizer, model = model_mod.build(spec, inputs, device=load_to)
        data = data_mod.load(spec.data, tokenizer, inputs, world=world, store=store, run_id=run_id)
    if load_to is not None:  # an inline model; a pretrained one is there already: no copy
        model.to(world.device)
    return tokenizer, model, data


def build_heldout(spec: JobSpec, world: World, store: ObjectStore, run_id: str, tokenizer,
                  data: data_mod.TokenStore) -> tuple[Any, Any]:
    """(the training samples, the held-out samples or None) of the spec's ``data.eval_fraction`` or
    ``data.eval_files``. A fraction splits ``data`` by sample (:mod:`elastic_ft.train.heldout`: two index
    arrays, 8 bytes per sample); eval files are a token store of their own, built and mapped as ``data``."""
    from elastic_ft.train import heldout

    cfg = spec.data
    if cfg.eval_fraction is not None:
        return heldout.split(data, cfg.eval_fraction, spec.seed)
    if not cfg.eval_files:
        return data, None
    held = dataclasses.replace(cfg, files=list(cfg.eval_files), eval_files=[], eval_fraction=None)
    with InputSource.from_spec(spec) as inputs:  # s3:// eval files: this node's cached copies
        return data, data_mod.load(held, tokenizer, inputs, world=world, store=store, run_id=run_id)


def build_evaluator(spec: JobSpec, world: World, events: EventLog, eval_data: Any) -> Evaluator | None:
    """The run's :class:`Evaluator` of the held-out samples (None without them)."""
    if eval_data is None:
        return None
    return Evaluator(eval_data, every_steps=spec.eval.every_steps, max_samples=spec.eval.max_samples,
                     micro_batch=spec.batch.micro_batch, world=world, events=events,
                     chunk_tokens=spec.model.loss_chunk_tokens,
                     autocast=lambda: precision.autocast(spec.precision, world.device))


def build_checkpoints(resources: contextlib.ExitStack, **kwargs: Any) -> Checkpoints:
    """The run's :class:`Checkpoints` (its saver's process group: a collective); closed before the events
    it reports to, giving the save in flight up when the run ends on an error."""
    checkpoints = Checkpoints(**kwargs)
    resources.push(lambda _type, exc, _tb: checkpoints.close(abandon=ends_on_error(exc)))
    return checkpoints


def build_preemption(spec: JobSpec, world: World, events: EventLog, endpoint: str,
                     resources: contextlib.ExitStack) -> Preemption:
    """The spot watcher and SIGTERM handler (closed first: the handler restored, the watcher stopped)."""
    preemption = Preemption(spec.spot, world, events, endpoint=endpoint)
    resources.callback(preemption.close)
    return preemption
