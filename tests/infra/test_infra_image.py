"""The training image: its Dockerfile passes hadolint and the project's structure checks; its entrypoint works.

No image is built here (no registry for the base images); the entrypoint is run as the container would run it.
"""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

import dockerfile_checks as checks
from conftest import AWS, REPO, tool

DOCKERFILE = (REPO / "Dockerfile").read_text()
ENTRYPOINT = AWS / "entrypoint.sh"


def _hadolint(path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True, timeout=120)


@pytest.mark.infra
def test_dockerfile_passes_hadolint():
    result = _hadolint(REPO / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.infra
def test_hadolint_reports_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.replace("USER ${UID}:${UID}", "USER root\nRUN apt-get install curl"))
    result = _hadolint(bad)
    assert result.returncode != 0 and "DL3002" in result.stdout  # last USER should not be root


def test_dockerfile_has_cpu_and_cuda_variants():
    assert checks.variant_problems(DOCKERFILE) == []


def test_dockerfile_installs_under_constraints_and_runs_as_non_root_offline():
    assert checks.install_problems(DOCKERFILE) == []
    assert checks.runtime_problems(DOCKERFILE) == []


def test_dockerfile_copies_only_paths_in_the_build_context():
    assert checks.context_problems(DOCKERFILE, REPO) == []


@pytest.mark.parametrize("old, new, check, expected", [
    ("ARG VARIANT=cpu\n", "ARG VARIANT=cuda\n", checks.variant_problems, "ARG VARIANT=cpu"),
    ("FROM nvidia/cuda:12.8.1-base-ubuntu24.04", "FROM ubuntu:24.04", checks.variant_problems, "nvidia/cuda"),
    ("https://download.pytorch.org/whl/cpu", "https://pypi.org/simple", checks.variant_problems, "CPU index"),
    ('pip install -c constraints.txt ".[qlora]"', 'pip install ".[qlora]"', checks.install_problems, "constraints"),
    ("COPY elastic_ft ./elastic_ft", "ADD https://example.com/x.tgz /x", checks.install_problems, "ADD"),
    ("USER ${UID}:${UID}", "USER root", checks.runtime_problems, "non-root"),
    ("    HF_HUB_OFFLINE=1 \\\n", "", checks.runtime_problems, "HF_HUB_OFFLINE"),
])
def test_structure_checks_catch_a_changed_dockerfile(old, new, check, expected):
    assert old in DOCKERFILE
    assert any(expected in p for p in check(DOCKERFILE.replace(old, new)))


def test_context_check_catches_an_ignored_or_missing_source():
    changed = DOCKERFILE.replace("COPY specs ./specs", "COPY tests ./tests\nCOPY nowhere ./nowhere")
    problems = checks.context_problems(changed, REPO)
    assert any("tests: excluded" in p for p in problems) and any("nowhere: no such path" in p for p in problems)


@pytest.mark.infra
def test_entrypoint_passes_shellcheck():
    result = subprocess.run([tool("shellcheck"), str(ENTRYPOINT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _entrypoint(tmp_path, *command: str, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")}
    return subprocess.run(["sh", str(ENTRYPOINT), *command], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.infra
def test_entrypoint_writes_the_etcd_ca_for_this_user_only_and_runs_the_command(tmp_path):
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
    result = _entrypoint(tmp_path, "sh", "-c", 'cat "$ELASTIC_FT_ETCD_DIR/ca.pem"; umask',
                         ELASTIC_FT_ETCD_CA_PEM=pem, ELASTIC_FT_ETCD_DIR=str(tmp_path / "etcd"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:3] == pem.splitlines()
    assert stat.S_IMODE((tmp_path / "etcd" / "ca.pem").stat().st_mode) == 0o600
    # The command runs with the umask it was given, not the file's 077.
    assert result.stdout.splitlines()[-1] != "0077"


@pytest.mark.infra
def test_entrypoint_defaults_to_the_home_directory_and_passes_the_exit_status(tmp_path):
    result = _entrypoint(tmp_path, "sh", "-c", "exit 75", ELASTIC_FT_ETCD_CA_PEM="x")
    assert result.returncode == 75
    assert (tmp_path / "home" / ".etcd" / "ca.pem").read_text() == "x\n"


@pytest.mark.infra
def test_entrypoint_without_the_ca_writes_nothing(tmp_path):
    result = _entrypoint(tmp_path, "true")
    assert result.returncode == 0 and not (tmp_path / "home").exists()


@pytest.mark.infra
def test_entrypoint_without_a_command_says_so(tmp_path):
    result = _entrypoint(tmp_path)
    assert result.returncode == 2 and "no command given" in result.stderr
