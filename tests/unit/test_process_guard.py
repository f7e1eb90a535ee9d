"""The suite's own check that a test starting a process or a server carries its marker (tests/process_guard.py).

The guard runs in a pytest of its own here, on small test files written for it: an unmarked launch must
fail the test that made it, naming the command and the marker to add; a marked one, or one whose marker
comes from a server fixture it uses, must pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO, process_env
from tests.process_guard import PROCESS_MARKERS, markers_for_fixtures, needed_marker


def test_every_marker_the_guard_names_is_registered_with_pytest():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        registered = {line.split(":", 1)[0] for line in tomllib.load(f)["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(PROCESS_MARKERS) | {"slow"} <= registered


@pytest.mark.parametrize("argv, marker", [
    ([sys.executable, "-m", "torch.distributed.run", "--standalone", "-m", "elastic_ft.worker"], "torchrun"),
    ([sys.executable, "-m", "elastic_ft.worker", "--spec", "x"], "torchrun"),
    (["/venv/bin/torchx", "run", "-s", "local_cwd", "elastic_ft.train"], "torchrun"),
    ([sys.executable, "-m", "elastic_ft.cli", "train", "--spec", "x"], "torchrun"),
    (["/usr/bin/etcd", "--name", "default"], "etcd"),
    (["etcdctl", "get", "k"], "etcd"),
    (["/venv/bin/weed", "mini"], "s3server"),
    (["/venv/bin/moto_server", "-p", "0"], "s3server"),
    (["/venv/bin/hadolint", "Dockerfile"], "infra"),
    ([sys.executable, "-m", "elastic_ft.cli", "ckpt", "verify", "file:///x"], None),
    ([sys.executable, "-c", "import elastic_ft"], None),
])
def test_a_command_calls_for_the_marker_of_what_it_starts(argv, marker):
    assert needed_marker(argv) == marker


def test_server_fixtures_mark_the_tests_that_use_them():
    assert markers_for_fixtures(["tmp_path", "etcd", "run_id"]) == {"etcd"}
    assert markers_for_fixtures(["etcd_tls", "seaweed"]) == {"etcd", "s3server"}
    assert markers_for_fixtures(["resumed_run"]) == {"torchrun"}
    # The S3 servers start when a test first asks for one: `backend` on the filesystem asks for none.
    assert markers_for_fixtures(["backend", "s3_servers"], {"backend": "moto"}) == {"s3server"}
    assert markers_for_fixtures(["backend", "s3_servers"], {"backend": "file"}) == set()
    assert markers_for_fixtures(["tmp_path", "capsys"]) == set()


CONFTEST = """
import pytest
from tests.process_guard import (pytest_collection_modifyitems, pytest_configure, pytest_runtest_makereport,
                                 pytest_runtest_protocol, pytest_unconfigure)

@pytest.fixture
def etcd():
    return "a server fixture's name is enough to mark the test"
"""

TESTS = """
import multiprocessing, subprocess, sys
import pytest

def test_unmarked_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.subprocess
def test_marked_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.subprocess
def test_etcd_under_the_wrong_marker():
    with pytest.raises(FileNotFoundError):
        subprocess.Popen(["/nonexistent/bin/etcd", "--name", "x"])

def test_etcd_marked_by_its_fixture(etcd):
    with pytest.raises(FileNotFoundError):
        subprocess.Popen(["/nonexistent/bin/etcd", "--name", "x"])

@pytest.fixture
def child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_fixture_launch(child):
    pass

def test_unmarked_multiprocessing():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()

def test_no_launch():
    assert sum(range(4)) == 6
"""


@pytest.mark.subprocess
def test_an_unmarked_launch_fails_its_test_naming_the_command_and_the_marker(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_launches.py").write_text(TESTS)
    markers = "\n".join(f"    {m}: x" for m in PROCESS_MARKERS)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\naddopts = --strict-markers\nmarkers =\n{markers}\n")
    env = process_env(PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    results = {line.split(" ")[1].split("::")[-1]: line.split(" ")[0] for line in out.splitlines()
               if line.startswith(("PASSED ", "FAILED ", "ERROR "))}
    assert results == {
        "test_unmarked_python": "FAILED", "test_marked_python": "PASSED",
        "test_etcd_under_the_wrong_marker": "FAILED", "test_etcd_marked_by_its_fixture": "PASSED",
        "test_unmarked_fixture_launch": "ERROR", "test_unmarked_multiprocessing": "FAILED",
        "test_no_launch": "PASSED",
    }, out
    assert "started the process `/nonexistent/bin/etcd --name x` (mark the test @pytest.mark.etcd)" in out, out
    assert "test_unmarked_fixture_launch (setup) launched what its markers do not cover" in out, out
    assert "(mark the test one of @pytest.mark.torchrun" in out, out
