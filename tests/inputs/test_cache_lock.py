"""The input cache's entry lock held by another process (a real one): the wait is bounded by
inputs.lock_timeout_s, logged, and the error names the holder's host and pid; once it is released the
lock is taken, and its file names the new holder."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from elastic_ft.config import ConfigError, spec_from_dict
from elastic_ft.inputs.cache import CacheLockTimeout, InputCache, entry_lock
from elastic_ft.inputs.settings import InputsConfig
from elastic_ft.inputs.uri import parse_object_uri
from tests.checkpoint.s3_servers import wait_until
from tests.conftest import REPO, process_env

HOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lock_holder.py")
URI = "s3://bucket/data/train.jsonl"


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock of URI's cache entry under ``tmp_path/cache``, released by the test."""
    cache = InputCache(str(tmp_path / "cache"), None, InputsConfig(cache_dir=str(tmp_path / "cache")))
    os.makedirs(cache.root)
    lock = cache._entry(parse_object_uri(URI)) + ".lock"
    held, release = tmp_path / "held", tmp_path / "release"
    proc = subprocess.Popen([sys.executable, HOLDER, lock, str(held), str(release)], env=process_env(PYTHONPATH=REPO),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(held.exists, timeout=60, what="the holder to take the lock")
        yield proc, lock, release
    finally:
        release.touch()
        proc.communicate(timeout=60)


@pytest.mark.subprocess  # a second process holds the lock
def test_a_held_entry_lock_is_waited_for_a_bounded_time_naming_its_holder(tmp_path, holder, caplog):
    proc, lock, release = holder
    cache = InputCache(str(tmp_path / "cache"), None, InputsConfig(cache_dir=str(tmp_path / "cache"),
                                                                    lock_timeout_s=1.5))
    caplog.set_level(logging.INFO, logger="elastic_ft.inputs.cache")
    t0 = time.monotonic()
    with pytest.raises(CacheLockTimeout) as err:
        cache.fetch_file(URI)  # the lock comes first: nothing is asked of S3 while it is held
    assert time.monotonic() - t0 < 10  # 1.5 s, not until the holder lets go (120 s)
    who = f"host {socket.gethostname()} pid {proc.pid}"
    assert f"lock {lock} is still held after 1.5 s (inputs.lock_timeout_s) by {who}" in str(err.value)
    assert "remove the lock file, else raise inputs.lock_timeout_s" in str(err.value)
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the input cache")]
    assert waiting and who in waiting[0], caplog.text

    release.touch()  # the holder lets go: the lock is taken, and names its new holder
    proc.communicate(timeout=60)
    with entry_lock(lock, timeout_s=30):
        with open(lock) as f:
            record = json.load(f)
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())


def test_the_lock_timeout_is_bounded():
    with pytest.raises(ConfigError, match="inputs.lock_timeout_s"):
        spec_from_dict({"inputs": {"lock_timeout_s": 0}})
