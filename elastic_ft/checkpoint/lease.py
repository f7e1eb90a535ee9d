"""The writer lease of a run: one live writer per run location, refused at start and fenced before each commit.

Two jobs started with the same run id and checkpoint location used to train
side by side until their manifests collided (three failed saves later). The
leader of a run now holds a lease in the run's own store, beside its
checkpoints, so it works alike on every store, with the one conditional
operation every store has (create-if-absent: ``If-None-Match: *`` on S3,
``O_EXCL`` + rename on a filesystem):

- ``lease/<generation>.json``: who took the lease (job, writer token, host,
  pid, when, and why it could), created if absent. The newest generation holds the run; taking
  the lease is creating the next one, so of two writers racing for it exactly
  one wins.
- ``lease/<generation>.renewed.json``: the holder's renewal, rewritten every
  ``ttl_s / 3`` (only the holder writes its generation's), ``released`` at a
  clean close.

:func:`decide` is the pure rule for taking it: free, released, expired (no
renewal for ``ttl_s``), held by the same job (an elastic restart: a new
leader, perhaps on another node, of the job that held it; see
:func:`job_identity`), or held by a process of this host that is gone;
otherwise refused, naming the holder. A writer that finds a newer generation
than its own (:meth:`WriterLease.check`, before every commit) has lost the
run and must not commit.

Clocks: expiry compares the holder's renewal time with the taker's clock, so
``ttl_s`` must exceed the clock skew between nodes by a margin (60 s against
NTP's milliseconds). Cost: one LIST of ``lease/`` per commit and one small PUT
per ``ttl_s / 3``, whatever the model, data or node count.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping

from elastic_ft.checkpoint.errors import ObjectExists, ObjectNotFound, StoreError
from elastic_ft.handoff import launch
from elastic_ft.checkpoint.store import ObjectStore

log = logging.getLogger(__name__)

PREFIX = "lease/"
DEFAULT_TTL_S = 60.0
JOB_ENV = "ELASTIC_FT_JOB_ID"
"""The job's identity across its restarts (the torchx component sets it to the app id)."""
_KEY = re.compile(r"^lease/(\d{10})\.json$")
_MAX_TRIES = 20


class LeaseHeld(StoreError):
    """Another live writer holds the run; the message names the run and that writer."""


class LeaseLost(StoreError):
    """This writer's lease was taken over; it must not commit."""


def lease_key(generation: int) -> str:
    return f"{PREFIX}{generation:010d}.json"


def renewal_key(generation: int) -> str:
    return f"{PREFIX}{generation:010d}.renewed.json"


def job_identity(environ: Mapping[str, str] | None = None, *, pid: int | None = None,
                 parent: int | None = None, host: str | None = None) -> str:
    """What stays the same across one job's restarts and differs between two jobs.

    ``ELASTIC_FT_JOB_ID`` when set (the component sets torchx's app id: the same on every node and
    every restart of a submission, new for the next submission). Else, under torchrun, its
    rendezvous run id (``TORCHELASTIC_RUN_ID``, ``--rdzv-id``): what names one job to torchrun, the
    same on every node and restart (``--standalone`` draws a new one per launch). torchrun's default
    id, ``none``, names no job: then the agent (this host, the worker's parent pid), so that a worker
    restart on the same agent is the same job and a new leader elsewhere waits for the lease's
    expiry. Else (no torchrun) this process alone.
    """
    environ = os.environ if environ is None else environ
    host = host or socket.gethostname()
    if environ.get(JOB_ENV):
        return f"job:{environ[JOB_ENV]}"
    rdzv_id = environ.get("TORCHELASTIC_RUN_ID")
    if rdzv_id and rdzv_id != "none":
        return f"torchrun:{rdzv_id}"
    if rdzv_id:
        return f"torchrun:none@{host}:{parent or launch.agent_pid()}"
    return f"process:{host}:{pid or os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(frozen=True)
class Holder:
    job: str
    writer: str
    host: str
    pid: int

    def doc(self, now: float) -> dict:
        return {"job": self.job, "writer": self.writer, "host": self.host, "pid": self.pid, "acquired": round(now, 3)}


@dataclasses.dataclass(frozen=True)
class LeaseState:
    """The newest generation of a run's lease, as read from the store."""

    generation: int
    doc: dict
    renewed: float
    """The holder's last renewal (its clock), or when it took the lease."""
    released: bool = False


def describe(doc: Mapping) -> str:
    return (f"writer {doc.get('writer')!r} of job {doc.get('job')!r} (pid {doc.get('pid')} on host "
            f"{doc.get('host')!r})")


def decide(current: LeaseState | None, me: Holder, now: float, ttl_s: float,
           alive: Callable[[int], bool]) -> tuple[bool, str]:
    """(take it, why): the pure rule of the module. ``alive(pid)``: whether a process of this host lives."""
    if current is None:
        return True, "no writer held the run"
    doc = current.doc
    if current.released:
        return True, f"{describe(doc)} released it"
    if doc.get("job") == me.job:
        return True, f"the same job's previous writer held it ({describe(doc)}): a restart takes it over"
    age = now - current.renewed
    if age > ttl_s:
        return True, f"the lease of {describe(doc)} expired {age - ttl_s:.0f} s ago"
    if doc.get("host") == me.host and isinstance(doc.get("pid"), int) and not alive(doc["pid"]):
        return True, f"{describe(doc)} is no longer running on this host"
    return False, (f"another writer is running: {describe(doc)}, lease renewed {max(age, 0):.0f} s ago "
                   f"(expires {ttl_s - age:.0f} s after its last renewal). Two jobs must not write one run: "
                   f"give this job its own run_id, or stop the other one first")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def read_state(store: ObjectStore) -> LeaseState | None:
    """The newest generation, with its renewal; None when the run has no lease yet."""
    generations = sorted(int(m.group(1)) for o in store.list(PREFIX) if (m := _KEY.match(o.key)))
    if not generations:
        return None
    g = generations[-1]
    try:
        doc = json.loads(bytes(store.get(lease_key(g))))
    except (ObjectNotFound, ValueError):
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    renewed, released = _number(doc.get("acquired")), False
    try:
        r = json.loads(bytes(store.get(renewal_key(g))))
        if isinstance(r, dict):
            renewed, released = max(renewed, _number(r.get("renewed"))), r.get("released") is True
    except (ObjectNotFound, ValueError):
        pass
    return LeaseState(g, doc, renewed, released)


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


class WriterLease:
    """The lease of the run in ``store``, held by ``holder`` once :meth:`acquire` returned."""

    def __init__(self, store: ObjectStore, run_id: str, holder: Holder, *, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time, alive: Callable[[int], bool] = pid_alive) -> None:
        self.store, self.run_id, self.holder, self.ttl_s = store, run_id, holder, ttl_s
        self.clock, self.alive = clock, alive
        self.generation: int | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str:
        """Take the lease (why it could be taken), or raise :class:`LeaseHeld` naming the run and the holder."""
        for _ in range(_MAX_TRIES):
            current = read_state(self.store)
            take, why = decide(current, self.holder, self.clock(), self.ttl_s, self.alive)
            if not take:
                raise LeaseHeld(f"run {self.run_id!r} at {self.store.uri} is refused to this writer: {why}")
            g = (current.generation if current else 0) + 1
            try:
                doc = {**self.holder.doc(self.clock()), "taken_because": why}
                self.store.put(lease_key(g), json.dumps(doc).encode(), if_absent=True)
            except ObjectExists:
                continue  # another writer took this generation first: look again
            self.generation = g
            self._renew()
            for old in range(max(1, g - 3), g - 1):  # keep the listing short; the newest few stay for the record
                for key in (lease_key(old), renewal_key(old)):
                    try:
                        self.store.delete(key)
                    except StoreError:
                        pass
            log.info("writer lease of run %r taken (generation %d): %s", self.run_id, g, why)
            return why
        raise LeaseHeld(f"run {self.run_id!r} at {self.store.uri}: the writer lease changed hands {_MAX_TRIES} "
                        f"times while this writer tried to take it; another job is starting on this run")

    def _renew(self, released: bool = False) -> None:
        doc = {"writer": self.holder.writer, "renewed": round(self.clock(), 3), "released": released}
        self.store.put(renewal_key(self.generation), json.dumps(doc).encode())

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless this writer still holds the run (its generation is the newest)."""
        if self.lost is None:
            current = read_state(self.store)
            if current is None or current.generation != self.generation:
                taker = describe(current.doc) if current else "nobody (the lease objects are gone)"
                self.lost = (f"run {self.run_id!r}: this writer's lease (generation {self.generation}) was taken "
                             f"over by {taker}; it stops without committing")
        if self.lost is not None:
            raise LeaseLost(self.lost)

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renewing, name="writer-lease", daemon=True)
        self._thread.start()

    def _renewing(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.check()
                self._renew()
            except LeaseLost as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # a store fault: the next renewal may work; expiry is ttl_s away
                log.warning("writer lease of run %r not renewed: %s", self.run_id, exc)

    def release(self) -> None:
        """At the writer's end: stop renewing and mark the lease released (best effort, never raises)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.generation is None or self.lost is not None:
            return
        try:
            self._renew(released=True)
        except Exception as exc:
            log.warning("writer lease of run %r not released (it expires in %.0f s): %s", self.run_id,
                        self.ttl_s, exc)
