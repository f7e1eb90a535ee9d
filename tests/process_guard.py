"""Every test that starts a process or a server says so with a marker; this plugin marks and checks.

The markers (registered in pyproject.toml) pick the test tiers: ``bash scripts/test.sh --quick`` runs
the tests that have none of ``PROCESS_MARKERS`` (nor ``slow``). A test without its marker would slip a
torchrun job or a server into the quick tier, so the markers are not left to memory:

- At collection, a test gets the markers of the server fixtures it uses (``FIXTURE_MARKERS``): asking
  for the ``etcd`` fixture starts etcd (or shares the session's), whoever wrote the test.
- At run time, ``subprocess.Popen`` and ``multiprocessing``'s ``Process.start`` are wrapped for the
  whole session, and the in-process servers of the tests (moto, the fault proxy) report their start
  through :func:`started`. A launch while a test runs (its set-up, call or teardown, fixtures
  included) that the test's markers do not cover fails that test, naming what it started and the
  marker to add. Launches outside a test (collection, session end) are not checked.

Stubs of ours that serve on a thread of the test process (the fake IMDS, the doctor's S3 "ignorer")
are fakes of a service, need nothing installed and start in milliseconds: they need no marker.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Iterable

import pytest

PROCESS_MARKERS = ("torchrun", "etcd", "s3server", "chaos", "infra", "subprocess")
"""Markers that say a test starts a process or a server (any one covers a launch the table below
does not name; ``subprocess`` is for the rest: the elastic-ft CLI, a clean ``python -c``)."""

FIXTURE_MARKERS = {
    "etcd": "etcd", "etcd_private": "etcd", "etcd_tls": "etcd",
    "seaweed": "s3server", "seaweedfs": "s3server", "moto": "s3server", "fault_proxy": "s3server",
    "moto_remote": "s3server", "remote": "s3server",  # remote: moto or SeaweedFS, never the filesystem
    "resumed_run": "torchrun",
}
"""Fixtures that start (or share) a server or a job, and the marker a test that uses one gets."""

LAZY_S3 = "s3_servers"
"""Starts an S3 server when a test first asks it for one: marks ``s3server`` unless the test is
parametrized to the filesystem (``backend``, ``race_store``: ``file``), where it asks for none."""

_TOOLS = {
    "torchrun": "torchrun", "torchx": "torchrun",
    "etcd": "etcd", "etcdctl": "etcd",
    "weed": "s3server", "moto_server": "s3server",
    "cfn-lint": "infra", "hadolint": "infra", "shellcheck": "infra",
}
_MODULES = {"torch.distributed.run": "torchrun", "elastic_ft.worker": "torchrun"}


def needed_marker(argv: Iterable[str]) -> str | None:
    """The marker a command line calls for, or None where any of ``PROCESS_MARKERS`` will do."""
    args = [os.fspath(a) for a in argv]
    if not args:
        return None
    tool = _TOOLS.get(os.path.basename(args[0]))
    if tool:
        return tool
    for i, arg in enumerate(args[:-1]):
        if arg == "-m" and args[i + 1] in _MODULES:
            return _MODULES[args[i + 1]]
    cli = os.path.basename(args[0]) == "elastic-ft" or "elastic_ft.cli" in args
    if cli and "train" in args:  # `elastic-ft train` runs torchx, which runs torchrun
        return "torchrun"
    return None


def markers_for_fixtures(fixturenames: Iterable[str], params: dict | None = None) -> set[str]:
    """The markers a test gets from the fixtures it uses (``params``: its parametrization)."""
    names = set(fixturenames)
    marks = {FIXTURE_MARKERS[n] for n in names if n in FIXTURE_MARKERS}
    if LAZY_S3 in names and not (params and "file" in params.values()):
        marks.add("s3server")
    return marks


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", None)
        have = {m.name for m in item.iter_markers()}
        for name in sorted(markers_for_fixtures(item.fixturenames, params) - have):
            item.add_marker(name)


# --------------------------------------------------------------------------- run-time check

_current: pytest.Item | None = None
_violations = pytest.StashKey[list]()
_reported = pytest.StashKey[int]()


def _record(what: str, need: str | None) -> None:
    item = _current
    if item is None:
        return
    have = {m.name for m in item.iter_markers()}
    if (need in have) if need else bool(have & set(PROCESS_MARKERS)):
        return
    hint = f"@pytest.mark.{need}" if need else "one of " + ", ".join(f"@pytest.mark.{m}" for m in PROCESS_MARKERS)
    item.stash.setdefault(_violations, []).append(f"{what} (mark the test {hint})")


def started(marker: str, what: str) -> None:
    """Called by a test server that runs in this process (no Popen to see) when it starts."""
    _record(f"started {what}", marker)


_real_popen_init = subprocess.Popen.__init__
_real_process_start = multiprocessing.process.BaseProcess.start


def _popen_init(self, args, *a, **kw):
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    shown = " ".join(os.fsdecode(x) if isinstance(x, bytes) else str(x) for x in argv)[:200]
    _record(f"started the process `{shown}`", needed_marker(argv) if not kw.get("shell") else None)
    return _real_popen_init(self, args, *a, **kw)


def _process_start(self):
    _record(f"started the process {self.name} (multiprocessing)", None)
    return _real_process_start(self)


def pytest_configure(config) -> None:
    subprocess.Popen.__init__ = _popen_init
    multiprocessing.process.BaseProcess.start = _process_start


def pytest_unconfigure(config) -> None:
    subprocess.Popen.__init__ = _real_popen_init
    multiprocessing.process.BaseProcess.start = _real_process_start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = item
    try:
        return (yield)
    finally:
        _current = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    found = item.stash.get(_violations, [])
    reported = item.stash.get(_reported, 0)
    if len(found) > reported:
        item.stash[_reported] = len(found)
        message = f"{item.nodeid} ({call.when}) launched what its markers do not cover:\n  " + "\n  ".join(
            found[reported:])
        if report.passed:
            report.outcome = "failed"
            report.longrepr = message
        else:  # it failed anyway: keep the note beside its own failure
            report.sections.append(("unmarked launch", message))
    return report

