"""The last completed step's trainable state, kept node-locally so that a restarted worker finds it.

torchrun restarts every worker of every node on any membership change, and a
restarted worker has lost what it held in memory. At every step end one rank per
node (its local rank 0: under DDP every rank holds the same state, and a local
rank needs no stable RANK) copies the trainable state to host memory and a
background thread writes it to a file in node-local shared memory (``/dev/shm``
where it exists, else the temp dir). After a restart the new world decides
(:mod:`elastic_ft.train.resume_source`) whether a node's kept step is newer than
the newest commit, and the holder sends it to every rank
(:mod:`elastic_ft.train.peer_state`).

The files: the state as safetensors in one of two slot files per worker
(``<name>-<pid>-<0|1>.safetensors``, tensors named ``<group>/<name>``: ``model/...``
and ``optimizer/...`` as a checkpoint holds them), mapped into the keeping rank's
memory, so the host copy of a step IS its write; and a JSON sidecar (``<name>.json``,
temp file and rename) naming the slot whose data is final, with its size and
checksum, the run id and config hash it belongs to, the step, cursor and what a
manifest records (batch plan, world, scheduler). A step is copied into the slot the
sidecar does not name: a torn, overwritten, foreign or stale state is refused
(:func:`read_kept`), never half-read. Nothing here is ever unpickled.

``<name>`` holds the run and the node's torchrun agent (its pid and start time):
a worker restarted by the same agent finds its node's file; another job on the
same host (a whole-job restart) or another agent on it (the tests run several
nodes on one host) does not. The directory is private (0700, owned by this user,
a symlink refused).

Cost per step on the keeping rank: one host copy of the trainable state into the
mapped slot (adapters and optimizer state: grows with the trainable parameters,
not with the frozen base, the dataset or the node count); the checksum (CRC-32)
and the sidecar run on the writer thread, and the step waits only when the
previous step's are still running. Memory: two slots of the trainable state in
shared memory per node (three while a restarted worker's first step is kept).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import threading
import time
import zlib
from typing import Any

import torch

from elastic_ft.checkpoint.codec import tensors_from_safetensors
from elastic_ft.checkpoint.safetensors_header import encode_header
from elastic_ft.train.kept_files import (
    KeptStateError, discard, identity_of, open_own, read_all, unlink_quiet, write_atomically,
)

log = logging.getLogger(__name__)

FORMAT = "elastic_ft.kept_state/1"
MAX_SIDECAR_BYTES = 64 << 20
"""A sidecar larger than this is not ours: it holds a few fields, the spec and the events of the steps since
the last save (at most :data:`elastic_ft.train.metrics.MAX_RECORDS` of them)."""
WRITE_WAIT_S = 30.0
"""Longest wait for a write in flight when the run stops (its file is what the next worker resumes from)."""
WRITER_NICE = 10
"""The writer thread's nice value (CFS weight ~1/10 of a training thread's when they compete for a core)."""
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


@dataclasses.dataclass(frozen=True)
class KeptState:
    """A kept state read back and verified: the sidecar's fields and the safetensors bytes."""

    meta: dict[str, Any]
    """The sidecar: ``format, run_id, config_hash, step, cursor, agent, host, file, size, crc32`` and the
    manifest fields (``batch_plan``, ``world``, ``scheduler``, ``rng``), ``documents`` (spec, trainer)."""
    data: bytearray
    """The safetensors file, verified against the sidecar's size and checksum."""

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def identity(self) -> int:
        return identity_of(self.meta["run_id"], self.meta["config_hash"])

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The state's tensor groups (``model``, ``optimizer``), views of :attr:`data`."""
        return split_groups(tensors_from_safetensors(self.data, key=self.meta.get("file")))


def split_groups(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        group, _, name = key.partition("/")
        out.setdefault(group, {})[name] = t
    return out


def read_kept(directory: str, name: str, *, run_id: str | None, config_hash: str | None,
              ) -> tuple[KeptState | None, str]:
    """The state kept under ``name`` if it is whole and belongs to (``run_id``, ``config_hash``): (state, why).

    ``run_id`` None: any run's and config's (the caller judges :attr:`KeptState.identity`).
    (None, why) for none there, a torn or malformed file, a size or digest that does not match, or a state
    of another run or config; never raises for what the files hold. Cost: one read of the state and its checksum.
    """
    side = os.path.join(directory, f"{name}.json")
    try:
        fd = open_own(side, os.O_RDONLY)
    except FileNotFoundError:
        return None, "no state kept on this node"
    except (OSError, KeptStateError) as exc:
        return None, f"kept state sidecar unusable: {exc}"
    try:
        size = os.fstat(fd).st_size
        if size > MAX_SIDECAR_BYTES:
            return None, f"kept state sidecar is {size} bytes (at most {MAX_SIDECAR_BYTES})"
        meta = json.loads(bytes(read_all(fd, size)))
    except (OSError, ValueError, KeptStateError) as exc:
        return None, f"kept state sidecar unreadable: {exc}"
    finally:
        os.close(fd)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None, "kept state sidecar is not in this version's format"
    if not isinstance(meta.get("run_id"), str) or not isinstance(meta.get("config_hash"), str):
        return None, "kept state sidecar is malformed"
    if run_id is not None and (meta["run_id"] != run_id or meta["config_hash"] != config_hash):
        return None, (f"kept state belongs to run {meta.get('run_id')!r} config {meta.get('config_hash')!r}, "
                      f"not this run's")
    file, want = meta.get("file"), meta.get("size")
    if (not isinstance(file, str) or not _NAME_RE.match(file) or not isinstance(want, int)
            or not isinstance(meta.get("step"), int) or not isinstance(meta.get("cursor"), int)):
        return None, "kept state sidecar is malformed"
    try:
        fd = open_own(os.path.join(directory, file), os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != want:
                return None, f"kept state file {file} is {os.fstat(fd).st_size} bytes, its sidecar says {want}"
            data = read_all(fd, want)
        finally:
            os.close(fd)
    except (OSError, KeptStateError) as exc:
        return None, f"kept state file unreadable: {exc}"
    if checksum(data) != meta.get("crc32"):
        return None, f"kept state file {file} does not match its sidecar's checksum (torn or overwritten)"
    state = KeptState(meta, data)
    try:
        state.tensors()
    except Exception as exc:  # a header that does not parse: not a usable state
        return None, f"kept state file {file} is malformed: {exc}"
    return state, f"step {state.step} kept on this node"


def checksum(data) -> str:
    """The digest a sidecar records of its data file: CRC-32 (zlib's; it releases the GIL for large buffers,
    and costs under half of sha256 here: 7 ms against 17 ms for 30 MB). It tells a torn or half-overwritten
    file; the directory is private, so no adversary chooses the bytes."""
    return f"{zlib.crc32(data):08x}"


@dataclasses.dataclass
class Slot:
    """One of a keeper's two state files, mapped: the host buffer a step's state is copied into.

    A safetensors file whose header is written once (the state's layout does not change within a worker's
    life) and whose data region is the mapped memory, so keeping a step costs one copy into it and a
    checksum of it: no write of the state, no second copy.
    """

    file: str
    size: int
    mapped: torch.Tensor
    """uint8, the whole file (``MAP_SHARED``)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    """(source tensor, its view in the mapping), in the caller's order."""


def make_slot(directory: str, file: str, tensors: dict[str, dict[str, torch.Tensor]]) -> Slot:
    """Create ``file`` (a safetensors file of ``tensors``' layout, data zero) and map it."""
    flat = {f"{g}/{k}": t for g, d in tensors.items() for k, t in d.items()}
    header: dict[str, Any] = {}
    offset = 0
    # Widest dtype first (as the codec writes): each tensor's offset is a multiple of its element size, and the
    # data starts at a multiple of 8, so every view below is aligned.
    for key in sorted(flat, key=lambda k: (-flat[k].element_size(), k)):
        t = flat[key]
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = encode_header(header)
    size = len(head) + offset
    write_atomically(directory, file, head)
    path = os.path.join(directory, file)
    fd = open_own(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)  # the data region: zero pages, allocated as the first copy touches them
    finally:
        os.close(fd)
    mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    base = len(head)
    views = {}
    for key, entry in header.items():
        start, end = entry["data_offsets"]
        t = flat[key]
        views[key] = mapped[base + start: base + end].view(t.dtype).view(t.shape)
    return Slot(file, size, mapped, [(flat[k], views[k]) for k in flat])


def _dtype_name(dtype: torch.dtype) -> str:
    from elastic_ft.checkpoint.codec import _WRITER_NAMES

    if dtype not in _WRITER_NAMES:
        raise KeptStateError(f"cannot keep a tensor of dtype {dtype}")
    return _WRITER_NAMES[dtype]


def write_kept(directory: str, name: str, tensors: dict[str, dict[str, torch.Tensor]], meta: dict) -> None:
    """Write a state (host tensors by group) and its sidecar at once, without a keeper (tests, tools): one slot."""
    slot = make_slot(directory, f"{name}-{os.getpid()}-w.safetensors", tensors)
    with torch.no_grad():
        for src, dst in slot.pairs:
            dst.copy_(src)
    write_sidecar(directory, name, slot, meta)


def write_sidecar(directory: str, name: str, slot: Slot, meta: dict) -> None:
    """The sidecar naming ``slot`` (whose data is final) with its size and checksum, written atomically: from
    this rename on, ``slot`` is the node's kept step."""
    data = memoryview(slot.mapped.numpy())
    side = json.dumps({**meta, "format": FORMAT, "file": slot.file, "size": slot.size, "crc32": checksum(data)})
    write_atomically(directory, f"{name}.json", side.encode())


class Keeper:
    """Keeps each completed step (:meth:`keep`); :meth:`close` ends it.

    Two mapped slot files (:class:`Slot`) double-buffer the state: a step is copied into the slot the sidecar
    does not name, then handed to the writer thread, which checksums it and writes the sidecar naming it. A
    step waits only when the previous step's checksum and sidecar are not done yet (its slot would otherwise
    be the one the sidecar still names). On a GPU the copy is queued non-blocking on a side stream, after the
    step's work; the training stream waits for it on the device, and the writer waits for its event before
    the checksum. A failed sidecar write is logged; the previous sidecar stays whole and the next step tries
    again. A new worker's keeper makes its own slots (the previous worker's stay named until its first
    sidecar lands, then are removed).
    """

    def __init__(self, directory: str, name: str) -> None:
        self.directory, self.name = directory, name
        self._slots: list[Slot | None] = [None, None]
        self._next = 0
        self._cond = threading.Condition()
        self._pending: tuple[int, dict, Any] | None = None  # (slot index, meta, copy-done event)
        self._busy = False
        self._closed = False
        self._cleaned = False
        self.written_step = 0
        """The newest step whose sidecar landed (0: none yet)."""
        self.failures = 0
        self.wait_s = 0.0
        """Seconds :meth:`keep` waited for the writer, in all (what the step loop paid beyond the copy)."""
        self._thread = threading.Thread(target=self._run, name="elastic_ft-kept-state", daemon=True)
        self._thread.start()

    def _slot_for(self, index: int, tensors: dict[str, dict[str, torch.Tensor]]) -> Slot:
        """Slot ``index`` for ``tensors``, made at the first keep and again only when the state's tensors change
        (AdamW's moments appear at the first step): ``tensors`` are the same objects from step to step."""
        slot = self._slots[index]
        sources = [t for d in tensors.values() for t in d.values()]
        if slot is None or len(slot.pairs) != len(sources) or any(a is not b for a, (b, _) in zip(sources, slot.pairs)):
            slot = make_slot(self.directory, f"{self.name}-{os.getpid()}-{index}.safetensors", tensors)
            self._slots[index] = slot
        return slot

    def keep(self, tensors: dict[str, dict[str, torch.Tensor]], meta: dict) -> None:
        """Keep the state of the step just completed (``meta["step"]``): copied now, made the node's kept step
        in the background."""
        t0 = time.monotonic()
        with self._cond:  # the slot about to be overwritten may still be named until the previous write is done
            while self._busy or self._pending is not None:
                if self._closed:
                    return
                self._cond.wait()
        self.wait_s += time.monotonic() - t0
        index = self._next
        pairs = self._slot_for(index, tensors).pairs
        done = None
        on_cuda = [(t, b) for t, b in pairs if t.is_cuda]
        on_host = [(t, b) for t, b in pairs if not t.is_cuda]
        with torch.no_grad():
            if on_cuda:
                current = torch.cuda.current_stream(on_cuda[0][0].device)
                side = self._side_stream(on_cuda[0][0].device)
                side.wait_stream(current)  # after the step's last kernel
                with torch.cuda.stream(side):
                    torch._foreach_copy_([b for _, b in on_cuda], [t for t, _ in on_cuda], non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
                current.wait_event(done)  # the next step's update waits for the copy, on the device
            if on_host:
                torch._foreach_copy_([b for _, b in on_host], [t for t, _ in on_host])  # one call for all
        with self._cond:
            self._pending = (index, dict(meta), done)
            self._next = 1 - index
            self._cond.notify_all()

    _side: Any = None

    def _side_stream(self, device):
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _run(self) -> None:
        # The checksum yields the cores to the training threads: it has a whole step to finish, they have not.
        # (Linux: a thread's nice value is its own; elsewhere this would renice the process, so it is skipped.)
        if sys.platform.startswith("linux") and hasattr(threading, "get_native_id"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
            except OSError:
                pass
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                index, meta, done = self._pending
                self._pending, self._busy = None, True
            try:
                if done is not None:
                    done.synchronize()
                slot = self._slots[index]
                assert slot is not None
                write_sidecar(self.directory, self.name, slot, meta)
                self.written_step = int(meta["step"])
                if not self._cleaned:  # a previous worker's slots, named no more
                    self._cleaned = True
                    own = {s.file for s in self._slots if s is not None}
                    for other in os.listdir(self.directory):
                        if other.startswith(f"{self.name}-") and other.endswith(".safetensors") and other not in own:
                            unlink_quiet(os.path.join(self.directory, other))
            except Exception as exc:  # the previous sidecar stays whole; the next step tries again
                self.failures += 1
                log.warning("keeping step %s in %s failed: %s", meta.get("step"), self.directory, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout: float = WRITE_WAIT_S) -> bool:
        """Wait (at most ``timeout`` s) until every kept step is written; True if so."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy or self._pending is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, *, discard_files: bool = False) -> None:
        """Finish the write in flight (bounded: the next worker resumes from it), stop the thread; with
        ``discard_files`` (the run ended normally) remove this node's files."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=WRITE_WAIT_S)
        self._slots = [None, None]  # unmapped once their tensors go
        if discard_files:
            discard(self.directory, self.name)


