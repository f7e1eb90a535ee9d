"""The manifest: the commit marker of a checkpoint, and its parsing.

A checkpoint exists only once ``manifests/<step>.json`` exists. The manifest
names every blob with its key, size and sha256 (over 1 MiB chunks, so loads
hash in parallel: :mod:`elastic_ft.checkpoint.digest`), so a load can verify
every byte. It is plain JSON (never pickle), and strict: a manifest of another run
or of an unknown format version is an error, not something to guess at.

Parse errors come in two kinds, because readers act on them differently:
:class:`ManifestCorrupt` (not JSON, torn, too large or too deep, a field missing
or malformed: the checkpoint is broken and may be retired) and
:class:`ManifestForeign` (a well-formed manifest of another run or format
version: the URI points somewhere wrong, and nothing may be retired).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

FORMAT = "elastic_ft.checkpoint/2"
"""Format 1 recorded plain sha256 digests (no ``chunk_size``); format 2 adds chunked ones."""
MANIFEST_PREFIX = "manifests/"
BLOB_PREFIX = "blobs/"
_MANIFEST_RE = re.compile(r"^manifests/(\d{12})\.json$")
MAX_MANIFEST_BYTES = 16 << 20
"""A manifest lists blobs, not data: ours are kilobytes. Anything larger is not one
of ours, and is refused before it is downloaded or parsed."""
MAX_MANIFEST_DEPTH = 32
"""Nesting limit checked before parsing: ours nest 4 deep, and ``json`` recurses
once per level (a deep document raises ``RecursionError`` without naming the file)."""


class ManifestError(ValueError):
    """A manifest that cannot be used: unparsable, foreign, or of another format."""


class ManifestCorrupt(ManifestError):
    """The manifest is broken (torn, truncated, oversized, malformed): its checkpoint is unusable."""


class ManifestForeign(ManifestError):
    """A well-formed manifest of another run or format version: a hard stop, never retired."""


@dataclasses.dataclass(frozen=True)
class BlobRef:
    key: str
    size: int
    sha256: str
    chunk_size: int = 0
    """The chunking of ``sha256`` (:mod:`elastic_ft.checkpoint.digest`); 0: a plain sha256."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    run_id: str
    step: int
    cursor: int
    """Global samples consumed when this checkpoint was taken."""
    created: float
    writer: str
    """Token unique to the writing attempt; tells our own retried commit from a rival's."""
    config_hash: str
    blobs: dict[str, BlobRef]
    world: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The world at save (informational: nothing on load depends on it)."""
    rng: dict[str, Any] = dataclasses.field(default_factory=dict)
    scheduler: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_plan: dict[str, Any] = dataclasses.field(default_factory=dict)
    eval: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The evaluation of this checkpoint's weights (``step``, ``loss``, ``tokens``, ``samples``), where there
    was one: retention's ``keep_best`` reads the loss here, without the blobs. {}: not evaluated."""
    format: str = FORMAT

    @property
    def key(self) -> str:
        return manifest_key(self.step)

    @property
    def total_size(self) -> int:
        return sum(b.size for b in self.blobs.values())

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        return json.dumps(d, indent=1, sort_keys=True).encode()


def manifest_key(step: int) -> str:
    return f"{MANIFEST_PREFIX}{step:012d}.json"


def step_of_key(key: str) -> int | None:
    """The step a manifest key names, or None if ``key`` is not a manifest key."""
    m = _MANIFEST_RE.match(key)
    return int(m.group(1)) if m else None


def check_manifest_size(size: int, *, key: str) -> None:
    """Raise :class:`ManifestCorrupt` naming ``key`` if ``size`` bytes is more than a manifest can be."""
    if size > MAX_MANIFEST_BYTES:
        raise ManifestCorrupt(
            f"manifest {key!r} has {size:,} bytes, more than the {MAX_MANIFEST_BYTES:,} a manifest may have; "
            f"it is not a checkpoint manifest"
        )


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


def json_depth_exceeds(data: bytes | memoryview, limit: int) -> bool:
    """Whether the JSON text ``data`` nests arrays/objects deeper than ``limit``.

    String contents (escapes included) are dropped first, so a bracket inside a
    string does not count. It does not validate: malformed text is left for the
    parser to reject (an unterminated string hides the brackets after it, which
    the parser then refuses anyway).
    """
    brackets = _NOT_BRACKET.sub(b"", _JSON_STRING.sub(b"", bytes(data)))
    depth = 0
    for byte in brackets:
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return True
    return False


def _mapping(value: Any, field: str) -> dict:
    """An optional object field: {} when absent or null; TypeError (a corrupt manifest) when not an object."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{field} must be an object, got {type(value).__name__}")
    return value


def parse_manifest(data: bytes, *, key: str, expected_run_id: str | None = None) -> Manifest:
    """Parse and check one manifest; raises :class:`ManifestCorrupt` or :class:`ManifestForeign` naming ``key``.

    Size and nesting depth are checked before parsing (:data:`MAX_MANIFEST_BYTES`,
    :data:`MAX_MANIFEST_DEPTH`). A valid JSON object whose format or run id is
    not ours is foreign; anything else that is not a well-formed manifest is corrupt.
    """
    check_manifest_size(len(data), key=key)
    if json_depth_exceeds(data, MAX_MANIFEST_DEPTH):
        raise ManifestCorrupt(
            f"manifest {key!r} nests deeper than {MAX_MANIFEST_DEPTH} levels; it is not a checkpoint manifest"
        )
    try:
        d = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestCorrupt(f"manifest {key!r} is not valid JSON ({exc}): a torn or truncated write") from exc
    if not isinstance(d, dict):
        raise ManifestCorrupt(f"manifest {key!r} is not a JSON object")
    fmt = d.get("format")
    if fmt != FORMAT:
        # Format 1 (whole-blob digests) is written by no elastic_ft since format 2: refused as any other.
        raise ManifestForeign(
            f"manifest {key!r} has format {fmt!r}, an unsupported format (this elastic_ft reads only {FORMAT!r}); "
            f"use the elastic_ft version that wrote it, or start a new run_id"
        )
    run_id = d.get("run_id")
    if expected_run_id is not None and run_id != expected_run_id:
        raise ManifestForeign(
            f"manifest {key!r} belongs to run {run_id!r}, not {expected_run_id!r}; "
            f"point checkpoint_uri/run_id at this run's own directory"
        )
    try:
        blobs = {name: BlobRef(**ref) for name, ref in d["blobs"].items()}
        m = Manifest(
            run_id=run_id, step=int(d["step"]), cursor=int(d["cursor"]), created=float(d["created"]),
            writer=str(d["writer"]), config_hash=str(d["config_hash"]), blobs=blobs,
            world=d.get("world", {}), rng=d.get("rng", {}), scheduler=d.get("scheduler", {}),
            batch_plan=d.get("batch_plan", {}), eval=_mapping(d.get("eval"), "eval"), format=fmt,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestCorrupt(f"manifest {key!r} is missing or has a malformed field: {exc!r}") from exc
    if step_of_key(key) not in (None, m.step):
        raise ManifestCorrupt(f"manifest {key!r} records step {m.step}, which does not match its key")
    for name, ref in blobs.items():
        if not (isinstance(ref.size, int) and ref.size >= 0 and isinstance(ref.chunk_size, int) and ref.chunk_size >= 0):
            raise ManifestCorrupt(f"manifest {key!r}: blob {name!r} needs whole, non-negative size and chunk_size, got {ref}")
        if not ref.key.startswith(BLOB_PREFIX) or ".." in ref.key.split("/"):
            raise ManifestCorrupt(f"manifest {key!r} references blob {name!r} outside this run: {ref.key!r}")
    return m
