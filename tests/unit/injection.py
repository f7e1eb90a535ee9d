"""Shell-injection probes for the torchx component: texts that run a command if bash parses them.

Each probe ``touch``es its own marker file; :func:`run_planned` runs a planned
``bash -c`` line, as a node would, with a stub ``torchrun`` first on PATH that
records the arguments and environment it got. A probe that was quoted reaches
the stub intact and leaves no marker.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
from typing import Mapping

import pytest


def probes(markers: pathlib.Path) -> dict[str, str]:
    """Probe name -> text that creates ``markers/<name>`` if a shell parses it."""
    return {
        "substitution": f"$(touch {markers}/substitution)",
        "backticks": f"`touch {markers}/backticks`",
        "semicolon": f"; touch {markers}/semicolon",
        "newline": f"\ntouch {markers}/newline",
        "quote": f"'; touch {markers}/quote; '",
    }


PROBES = sorted(probes(pathlib.Path("/m")))


@pytest.fixture
def markers():
    """An empty directory where a probe that runs leaves its marker (a short path: no brackets of test ids)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="eft-probe-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def fired(markers: pathlib.Path) -> list[str]:
    """The probes whose command ran."""
    return sorted(os.listdir(markers))


def run_planned(line: str, env: Mapping[str, str], work: pathlib.Path) -> tuple[list[str], dict[str, str]]:
    """Run ``bash -c line`` with ``env`` and a stub torchrun; the argv and environment torchrun got."""
    stub_dir = work / "stub-bin"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "torchrun"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done > "$STUB_OUT/argv"\n'
                    'env -0 > "$STUB_OUT/env"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    out = work / "stub-out"
    out.mkdir(exist_ok=True)
    proc = subprocess.run(["bash", "-c", line], env={**env, "PATH": f"{stub_dir}:/usr/bin:/bin", "STUB_OUT": str(out)},
                          cwd=work, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (line, proc.stdout, proc.stderr)
    argv = (out / "argv").read_text().split("\0")[:-1]
    environ = dict(item.split("=", 1) for item in (out / "env").read_text().split("\0")[:-1])
    return argv, environ


# (flag, value with '@' where the probe goes): arguments whose text torchrun gets as it is, quoted.
# '--' is a spec override; '--env' a value in the nodes' environment (never parsed by a shell).
QUOTED = [
    ("--spec", "specs/x@.yaml"),
    ("--", "steps=1@"),
    ("--log_dir", "logs@"),
    ("--checkpoint_uri", "s3://bucket/runs@"),
    ("--rdzv_conf", "join_timeout=600@"),
    ("--env", "X=a@"),
]
# Arguments refused with one line naming the flag.
REFUSED = [
    ("--rdzv_endpoint", "h:2379@"),
    ("--run_id", "r@"),
    ("--env", "X@=1"),
    ("--nnodes", "1@"),
]


def received(flag: str, argv: list[str], environ: Mapping[str, str]) -> str:
    """What the node got for ``flag``: the override (last argument), X's value, or the flag's value."""
    if flag == "--":
        return argv[-1]
    if flag == "--env":
        return "X=" + environ["X"]
    return argv[argv.index(flag) + 1]
