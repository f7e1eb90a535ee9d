"""Asynchronous checkpoint saves, with the upload spread over the ranks.

At a step boundary every rank takes a host-memory :func:`snapshot` (the only
time training blocks) and hands it to its :class:`AsyncSaver`. A background
thread on each rank uploads that rank's shard; the threads then exchange their
blob references over a dedicated gloo group (so they never interleave with
the training thread's collectives), and the leader commits the manifest only
when every part is in. Saves are submitted in the same order on every rank,
which is what keeps those background collectives paired.

A failed part is retried with backoff, then reported (``on_error``) without
stopping training; :meth:`AsyncSaver.flush` makes the newest save durable or
raises, for the end of the job and for a preemption.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import tenacity
import torch.distributed as dist

from elastic_ft.checkpoint.manifest import BlobRef, Manifest
from elastic_ft.checkpoint.store import StoreError
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot

log = logging.getLogger(__name__)


class SaveFailed(RuntimeError):
    """A checkpoint was not committed; the message says which step and why."""


class AsyncSaver:
    def __init__(
        self,
        writer: CheckpointWriter,
        *,
        rank: int = 0,
        world_size: int = 1,
        group: "dist.ProcessGroup | None" = None,
        on_commit: Callable[[Manifest, Snapshot], None] | None = None,
        on_error: Callable[[Snapshot, BaseException], None] | None = None,
        part_attempts: int = 3,
    ) -> None:
        if world_size > 1 and group is None:
            raise ValueError("a multi-rank AsyncSaver needs a process group for its background collectives")
        self.writer, self.rank, self.world_size, self.group = writer, rank, world_size, group
        self.on_commit, self.on_error = on_commit, on_error
        self.part_attempts = part_attempts
        # One long-lived worker thread fed by a queue: starting a thread per save
        # cost the training loop ~6 ms on a busy host (Thread.start waits until
        # the new thread is scheduled), several % of a 0.2 s step.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def submit(self, snap: Snapshot, nonce: str) -> None:
        """Start saving ``snap`` in the background (after the previous save finishes)."""
        self.wait()
        self._error = None
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name="ckpt-saver", daemon=True)
            self._worker.start()
        self._idle.clear()
        self._jobs.put((snap, nonce))

    def save(self, snap: Snapshot, nonce: str) -> None:
        """Synchronous save: returns once committed, raises :class:`SaveFailed` otherwise."""
        self.submit(snap, nonce)
        self.flush()

    def wait(self) -> None:
        self._idle.wait()

    def flush(self) -> None:
        """Block until the newest save is done; raise if it failed."""
        self.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        """Wait for the save in flight, then stop the worker thread (errors stay for :meth:`flush`)."""
        self.wait()
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run(*job)
            finally:
                self._idle.set()

    # ------------------------------------------------------------------ background

    def _upload(self, snap: Snapshot, nonce: str) -> dict[str, BlobRef]:
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.part_attempts),
            wait=tenacity.wait_exponential(multiplier=0.5, max=8),
            retry=tenacity.retry_if_exception_type(StoreError),
            before_sleep=lambda rs: log.warning(
                "checkpoint step %d part %d/%d: attempt %d failed (%s); retrying", snap.step, self.rank,
                self.world_size, rs.attempt_number, rs.outcome.exception(),
            ),
            reraise=True,
        )
        return retrying(self.writer.upload_part, snap, nonce, part=self.rank, parts=self.world_size)

    def _run(self, snap: Snapshot, nonce: str) -> None:
        refs: dict[str, BlobRef] = {}
        problem = None
        try:
            refs = self._upload(snap, nonce)
        except Exception as exc:  # reported below, after the parts are gathered
            problem = f"part {self.rank}/{self.world_size}: {type(exc).__name__}: {exc}"
        try:
            gathered = [(refs, problem)]
            if self.world_size > 1:
                gathered = [None] * self.world_size
                dist.all_gather_object(gathered, (refs, problem), group=self.group)
            if self.rank != 0:
                if problem:
                    raise SaveFailed(f"checkpoint of step {snap.step} not committed: {problem}")
                return
            problems = [p for _, p in gathered if p]
            if problems:
                raise SaveFailed(
                    f"checkpoint of step {snap.step} not committed after {self.part_attempts} attempt(s) per part: "
                    + "; ".join(problems)
                )
            blobs: dict[str, BlobRef] = {}
            for part_refs, _ in gathered:
                blobs.update(part_refs)
            manifest = self.writer.commit_manifest(snap, blobs)
        except BaseException as exc:  # never raised on the training thread; flush() re-raises
            self._error = exc
            log.error("%s", exc)
            if self.on_error is not None:
                self.on_error(snap, exc)
            return
        if self.on_commit is not None:
            self.on_commit(manifest, snap)
