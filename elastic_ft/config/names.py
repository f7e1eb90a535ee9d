"""Run ids and job names: the one check every entry point uses.

A run id is a path component of every checkpoint key
(``<checkpoint_uri>/<run_id>/blobs/...``), a directory on a filesystem, the
rendezvous id in etcd, the ``{run_id}`` in the log directory and part of
torchx's app name (hence its log path). So it must stay exactly one safe path
component: ``../escaped`` would write outside ``checkpoint_uri``, and a name
longer than a filesystem allows (255 bytes per component) trains and then
fails at the first save.

Entry points (the torchx component, the ``elastic-ft``/worker command line,
the spec's ``name``) call :func:`name_problem` or :func:`check_name` once,
where the value comes in; nothing downstream re-checks.
"""

from __future__ import annotations

import re

MAX_NAME_LENGTH = 128
"""Characters (= bytes: the set is ASCII) in a run id or job name.

Why 128: the longest key the checkpoint writer makes under a run is about 70
bytes (``blobs/<12-digit step>-<8 hex>/optimizer-00001-of-00016.safetensors``,
``quarantine/<step>-<8 hex>.json``), so a 128-byte run id keeps a run's keys
under 210 bytes: far inside one filesystem path component (255 bytes) for the
run directory, and it leaves S3 (1024-byte keys) about 800 bytes for the
``checkpoint_uri`` prefix. It also fits etcd keys and torchx app names."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RULE = f"letters, digits, '.', '_' and '-', starting with a letter or digit, at most {MAX_NAME_LENGTH} characters"


class InvalidName(ValueError):
    """A run id or job name that cannot be used as one path component."""


def _show(value: str) -> str:
    # A megabyte-long argument must not become a megabyte-long error line.
    return repr(value) if len(value) <= 60 else f"{value[:40]!r}... ({len(value)} characters)"


def name_problem(value: object) -> str | None:
    """Why ``value`` cannot be a run id or job name, or None if it can.

    The character set excludes '/', so a name is always one path component,
    and the required first letter or digit excludes '.', '..' and hidden
    names. Empty and non-string values are refused too.
    """
    if not isinstance(value, str) or not value:
        return f"must be a non-empty name ({_RULE}), got {value!r}"
    if len(value) > MAX_NAME_LENGTH:
        return f"is {len(value)} characters long; the limit is {MAX_NAME_LENGTH} ({_show(value)})"
    if not _NAME_RE.fullmatch(value):
        return f"must use only {_RULE}; got {_show(value)}"
    return None


def check_name(value: str, what: str) -> str:
    """``value`` itself if it is a valid name; else :class:`InvalidName` starting with ``what``.

    ``what`` names where the value came from, e.g. ``"--run_id"`` or ``"name"``.
    """
    problem = name_problem(value)
    if problem is not None:
        raise InvalidName(f"{what} {problem}")
    return value
