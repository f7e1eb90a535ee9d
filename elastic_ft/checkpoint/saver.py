"""Asynchronous checkpoint saves, with the upload spread over the ranks.

At a step boundary every rank takes a host-memory :func:`snapshot` (the only
time training blocks) and hands it to its :class:`AsyncSaver`. A background
thread on each rank uploads that rank's shard; the threads then exchange their
blob references over a dedicated gloo group (so they never interleave with
the training thread's collectives), and the leader commits the manifest only
when every part is in. Saves are submitted in the same order on every rank,
which is what keeps those background collectives paired.

A sharded snapshot (``Snapshot.sharded``: FSDP2 DTensors) is saved instead
with :func:`elastic_ft.checkpoint.sharded.save_sharded`, one collective DCP
save over the same group (each rank writes its own shards); its checks are
agreed across ranks before it starts, and DCP raises a failure inside it on
every rank alike. The leader commits the manifest the same way.

Every rank learns every save's outcome: the parts' problems are gathered, and
the leader sends the manifest commit's outcome to the others. So each rank's
saver holds the same history, and :meth:`AsyncSaver.submit` and
:meth:`AsyncSaver.flush` (which wait for the previous save first) raise on
every rank alike, never on some while the others enter a collective.

A failed part is retried with backoff, then reported (``on_error``) without
stopping training, up to ``max_failed_saves`` failures in a row; the next
submit or flush then raises :class:`SavesFailing`: a run must not train for
hours with no checkpoint. A snapshot holding NaN or infinite values is never
committed, and stops the run the same way at once (training cannot repair it);
so does a manifest refused because another writer holds the run
(:class:`WriterFenced`: its lease was taken over, or that writer committed the
step first): retrying cannot help, and the run must not go on beside it.
Every wait is bounded by ``timeout_s`` (:class:`SaveTimeout`). The worker
thread survives anything its callbacks raise.

A run that ends on an error closes its saver with ``abandon``: the save in
flight is given up (a peer that died mid-save would hold the wait for
``timeout_s``), nothing of it committed, in :data:`ABANDON_WAIT_S` at most.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import tenacity
import torch
import torch.distributed as dist

from elastic_ft.checkpoint.dcp_metadata import METADATA_BLOB, SHARDED_PREFIX
from elastic_ft.checkpoint.lease import LeaseLost
from elastic_ft.checkpoint.manifest import BlobRef, Manifest
from elastic_ft.checkpoint.save_errors import (
    NonFiniteCheckpoint, SaveAbandoned, SaveFailed, SavesFailing, SaveTimeout, WriterFenced, nonfinite_tensors,
)
from elastic_ft.checkpoint.store import StoreError
from elastic_ft.checkpoint.writer import CheckpointConflict, CheckpointWriter, Snapshot, shard_tensors

log = logging.getLogger(__name__)

ABANDON_WAIT_S = 2.0
"""How long ``close(abandon=True)`` waits for the thread: a backoff or a gone peer's collective ends at
once; a stuck upload or collective does not, and is left to the process exit (a daemon thread)."""


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
        before_commit: Callable[[Snapshot], None] | None = None,
        part_attempts: int = 3,
        max_failed_saves: int = 3,
        timeout_s: float = 1800.0,
    ) -> None:
        """``group`` (all ranks, gloo) should have a timeout of about ``timeout_s``: it bounds
        the background collectives as ``timeout_s`` bounds the training thread's waits.
        ``before_commit`` runs on the leader once every part is in, before the manifest: what
        must be durable before the checkpoint exists (the run's events); if it raises, the
        manifest is not committed and the save fails."""
        if world_size > 1 and group is None:
            raise ValueError("a multi-rank AsyncSaver needs a process group for its background collectives")
        if max_failed_saves < 1 or not timeout_s > 0:
            raise ValueError(f"max_failed_saves ({max_failed_saves}) and timeout_s ({timeout_s}) must be positive")
        self.writer, self.rank, self.world_size, self.group = writer, rank, world_size, group
        self.on_commit, self.on_error, self.before_commit = on_commit, on_error, before_commit
        self.part_attempts, self.max_failed_saves, self.timeout_s = part_attempts, max_failed_saves, timeout_s
        # One long-lived worker thread fed by a queue: starting a thread per save
        # cost the training loop ~6 ms on a busy host (Thread.start waits until
        # the new thread is scheduled), several % of a 0.2 s step.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None
        self._step: int | None = None  # the save submitted last
        self._error: SaveFailed | None = None  # the newest save's failure, until flush() raises it
        self._stop: SaveFailed | None = None  # a refused snapshot: the run cannot go on
        self._timed_out = False
        self._abandoned = threading.Event()  # set by close(abandon=True): give up the save in flight
        self.failed_in_row = 0
        """Saves that failed since the last commit."""
        self.last_failure: SaveFailed | None = None
        self.callback_failures: list[str] = []
        """What ``on_commit``/``on_error`` raised (logged with its traceback; the save's outcome stands)."""

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def submit(self, snap: Snapshot, nonce: str) -> None:
        """Start saving ``snap`` in the background (after the previous save finishes).

        Raises :class:`SavesFailing` instead once ``max_failed_saves`` saves in a
        row failed or a snapshot was refused, and :class:`SaveTimeout` when the
        previous save does not finish in time.
        """
        self.wait()
        self._check()
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name="ckpt-saver", daemon=True)
            self._worker.start()
        self._step = snap.step
        self._idle.clear()
        self._jobs.put((snap, nonce))

    def save(self, snap: Snapshot, nonce: str) -> None:
        """Synchronous save: returns once committed, raises :class:`SaveFailed` otherwise."""
        self.submit(snap, nonce)
        self.flush()

    def wait(self) -> None:
        """Block until no save is in flight; :class:`SaveTimeout` after ``timeout_s``."""
        self._timed_out = not self._idle.wait(self.timeout_s)
        if self._timed_out:
            raise SaveTimeout(
                f"the checkpoint of step {self._step} did not finish within {self.timeout_s:g} s "
                f"(checkpoint.save_timeout_s) of uploading this rank's part, waiting for the other ranks' parts "
                f"and committing its manifest: the store or a rank is stuck"
            )

    def flush(self) -> None:
        """Block until the newest save is done; raise if it failed (:class:`SaveFailed` or a subclass)."""
        self.wait()
        self._check()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self, *, abandon: bool = False) -> bool:
        """Stop the worker thread (errors stay for :meth:`flush`); whether it stopped. Never raises.

        The save in flight is waited for (``timeout_s`` at most) and commits. ``abandon`` (the run ends
        on an error): it is given up, in :data:`ABANDON_WAIT_S` at most: retries and their backoff stop,
        no upload starts, the leader commits no manifest (its blobs are orphans for retention), no
        callback runs, and the saver saves no more. A thread inside an upload or a collective is left.
        """
        if abandon:
            self._abandoned.set()
            if self.busy:
                log.warning("checkpoint saver: giving up the save of step %s in flight (the run ends on an error)",
                            self._step)
            if self._worker is not None:  # it ends once the save in flight gives up, even after we return
                self._jobs.put(None)
        wait_s = min(self.timeout_s, ABANDON_WAIT_S) if abandon else self.timeout_s
        if self._timed_out or not self._idle.wait(wait_s):  # inside an upload or a collective: no flag ends it
            log.log(logging.WARNING if abandon else logging.ERROR, "checkpoint saver: the save of step %s is "
                    "still in flight; not waiting for it", self._step)
            return False
        if self._worker is not None:
            if not abandon:
                self._jobs.put(None)
            self._worker.join(wait_s)
            if self._worker.is_alive():
                return False
            self._worker = None
        return True

    def _give_up_if_abandoned(self, snap: Snapshot) -> None:
        """Raise :class:`SaveAbandoned` once :meth:`close` gave the save up."""
        if self._abandoned.is_set():
            raise SaveAbandoned(f"checkpoint of step {snap.step} not committed: abandoned, the run ends on an error")

    def _check(self) -> None:
        if self._abandoned.is_set():
            raise SaveAbandoned("the checkpoint saver was closed, giving its save up: it saves no more")
        if self._stop is not None:
            raise SavesFailing(str(self._stop)) from self._stop
        if self.failed_in_row >= self.max_failed_saves:
            raise SavesFailing(
                f"{self.failed_in_row} checkpoint saves in a row failed (limit {self.max_failed_saves}, "
                f"checkpoint.max_failed_saves); the last: {self.last_failure}"
            ) from self.last_failure

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run(*job)
            except BaseException:  # the thread must outlive any one save: the next one may work
                log.exception("checkpoint saver: unexpected error; the saver carries on")
            finally:
                self._idle.set()

    # ------------------------------------------------------------------ background

    def _run(self, snap: Snapshot, nonce: str) -> None:
        try:
            manifest = self._save(snap, nonce)
        except BaseException as exc:
            self._failed(snap, exc)
            return
        self.failed_in_row, self.last_failure, self._error = 0, None, None
        if manifest is not None and self.on_commit is not None:
            self._callback("on_commit", snap.step, self.on_commit, manifest, snap)

    def _failed(self, snap: Snapshot, exc: BaseException) -> None:
        if not isinstance(exc, SaveFailed):
            err = SaveFailed(f"checkpoint of step {snap.step} not committed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            exc = err
        assert isinstance(exc, SaveFailed)
        self._error, self.last_failure = exc, exc
        self.failed_in_row += 1
        if isinstance(exc, (NonFiniteCheckpoint, WriterFenced)):
            self._stop = exc
        log.error("%s", exc)
        if self.on_error is not None:
            self._callback("on_error", snap.step, self.on_error, snap, exc)

    def _callback(self, name: str, step: int, fn: Callable, *args) -> None:
        if self._abandoned.is_set():  # the run is closing what the callbacks report to (its events)
            return
        try:
            fn(*args)
        except Exception as exc:  # the save's outcome stands: report, and keep the thread for the next save
            log.exception("checkpoint saver: %s for step %d raised; the saver carries on", name, step)
            self.callback_failures.append(f"{name} for step {step}: {type(exc).__name__}: {exc}")

    def _upload(self, snap: Snapshot, nonce: str) -> dict[str, BlobRef]:
        def attempt() -> dict[str, BlobRef]:
            self._give_up_if_abandoned(snap)
            return self.writer.upload_part(snap, nonce, part=self.rank, parts=self.world_size)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.part_attempts),
            wait=tenacity.wait_exponential(multiplier=0.5, max=8),
            sleep=self._abandoned.wait,  # a backoff ends at once when the save is abandoned
            retry=tenacity.retry_if_exception_type(StoreError),
            before_sleep=lambda rs: log.warning(
                "checkpoint step %d part %d/%d: attempt %d failed (%s); retrying", snap.step, self.rank,
                self.world_size, rs.attempt_number, rs.outcome.exception(),
            ),
            reraise=True,
        )
        return retrying(attempt)

    def _upload_checked(self, snap: Snapshot, nonce: str) -> tuple[dict[str, BlobRef], str | None, bool]:
        """This rank's part: (blob refs, problem, whether the problem is non-finite state).

        Each rank checks the shard it uploads, so the whole checkpoint is checked
        once, in the background, at no cost to the training thread.
        """
        where = f"part {self.rank}/{self.world_size}"
        # Nothing may escape: a rank that raised here would skip the gather that
        # follows, and pair its next save's gather with this one of the others.
        try:
            mine = {group: shards[self.rank] for group, shards in shard_tensors(snap.tensors, self.world_size).items()}
            bad = nonfinite_tensors(mine)
            if bad:
                more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
                return {}, f"{where}: non-finite values (NaN or inf) in {', '.join(bad[:3])}{more}", True
            return self._upload(snap, nonce), None, False
        except Exception as exc:  # reported after the parts are gathered, the same on every rank
            problem = f"{where}: {type(exc).__name__}: {exc}"
            # The line goes to every rank, into the save's error; the traceback stays in this rank's log.
            log.info("checkpoint step %d %s", snap.step, problem)
            log.debug("checkpoint step %d %s: traceback", snap.step, where, exc_info=exc)
            return {}, problem, False

    def _save(self, snap: Snapshot, nonce: str) -> Manifest | None:
        """Upload, gather, commit: the manifest on the leader (None elsewhere), or the failure on every rank."""
        blobs = self._save_sharded(snap, nonce) if snap.sharded is not None else self._save_parts(snap, nonce)
        return self._commit(snap, blobs)

    def _gather(self, mine: tuple) -> list[tuple]:
        if self.world_size == 1:
            return [mine]
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        return gathered

    def _save_parts(self, snap: Snapshot, nonce: str) -> dict[str, BlobRef]:
        """Replicated state: each rank uploads its part; every blob on the leader ({} elsewhere)."""
        gathered = self._gather(self._upload_checked(snap, nonce))
        self._give_up_if_abandoned(snap)  # after the gather, which every rank makes
        _raise_problems(snap, [(p, nonfinite) for _, p, nonfinite in gathered],
                        f"after {self.part_attempts} attempt(s) per part")
        blobs: dict[str, BlobRef] = {}
        for part_refs, _, _ in gathered:
            blobs.update(part_refs)
        return blobs

    def _save_sharded(self, snap: Snapshot, nonce: str) -> dict[str, BlobRef]:
        """Sharded (DCP) state: checked on every rank, then saved collectively; every blob on the leader.

        The checks are agreed first (one gather), so that no rank starts the
        collective save while another refused it. A failure inside the save is
        one DCP gathers and raises on every rank, so it too fails the save alike.
        The save is not retried as a whole (every rank would have to agree to);
        each blob's put is (``part_attempts``), which is safe on its own.
        """
        # Imported here: torch.distributed.checkpoint is only needed by sharded runs.
        from elastic_ft.checkpoint.sharded import ShardedCheckpointError, local_shards, non_tensor_leaves, save_sharded

        where = f"rank {self.rank}/{self.world_size}"
        problem, nonfinite = None, False
        try:  # nothing may escape before the gather, or the ranks would pair the wrong collectives
            bad = non_tensor_leaves(snap.sharded) + [
                f"document {name!r} (a reserved name)" for name in snap.documents
                if name == "sharded" or name.startswith(SHARDED_PREFIX)]
            if bad:
                problem = f"{where}: not savable as sharded state: {', '.join(bad[:3])}"
            else:
                nonfinite_names = nonfinite_tensors(local_shards(snap.sharded))
                if nonfinite_names:
                    more = f" and {len(nonfinite_names) - 3} more" if len(nonfinite_names) > 3 else ""
                    problem, nonfinite = (f"{where}: non-finite values (NaN or inf) in "
                                          f"{', '.join(nonfinite_names[:3])}{more}"), True
        except Exception as exc:
            problem = f"{where}: {type(exc).__name__}: {exc}"
        _raise_problems(snap, self._gather((problem, nonfinite)), "")
        try:
            return save_sharded(self.writer, snap, nonce, self.group, attempts=self.part_attempts,
                                abandoned=self._abandoned)
        except ShardedCheckpointError as exc:
            raise SaveFailed(f"checkpoint of step {snap.step} not committed: {exc}") from exc

    def _commit(self, snap: Snapshot, blobs: dict[str, BlobRef]) -> Manifest | None:
        """The leader commits the manifest naming ``blobs``; every rank learns the outcome."""
        manifest, outcome, cause, fenced = None, None, None, False
        if self.rank == 0:
            try:
                if snap.sharded is not None and METADATA_BLOB not in blobs:
                    # DCP's coordinator is the group's rank 0: this saver's rank must be that rank.
                    raise ValueError("this saver's rank 0 is not rank 0 of its process group, so it does not hold "
                                     "the sharded save's blobs; give AsyncSaver each rank's rank within its group")
                self._give_up_if_abandoned(snap)
                if self.before_commit is not None:
                    self.before_commit(snap)
                manifest = self.writer.commit_manifest(snap, blobs)
            except Exception as exc:
                outcome, cause = f"{type(exc).__name__}: {exc}", exc
                fenced = isinstance(exc, (LeaseLost, CheckpointConflict))
        if self.world_size > 1:  # the others learn whether the manifest landed
            box = [(outcome, fenced)]
            dist.broadcast_object_list(box, src=0, group=self.group)
            outcome, fenced = box[0]
        if outcome is not None:
            kind = WriterFenced if fenced else SaveFailed
            raise kind(f"checkpoint of step {snap.step} not committed: its manifest: {outcome}") from cause
        return manifest


def _raise_problems(snap: Snapshot, gathered: list[tuple[str | None, bool]], attempts: str) -> None:
    """Raise the ranks' problems (the same on every rank: each holds the gathered list)."""
    problems = [p for p, _ in gathered if p]
    if any(nonfinite for _, nonfinite in gathered):
        raise NonFiniteCheckpoint(
            f"checkpoint of step {snap.step} refused: the trainable state or optimizer state holds non-finite "
            f"values, and a checkpoint is never committed from them: " + "; ".join(problems)
        )
    if problems:
        raise SaveFailed(f"checkpoint of step {snap.step} not committed{' ' + attempts if attempts else ''}: "
                         + "; ".join(problems))
