"""Installing elastic_ft keeps torchx's own default scheduler.

torchx takes the first entry of the ``torchx.schedulers`` group as the default
of ``torchx run`` without ``-s``. Our group registers torchx's schedulers again
(an entry hides the built-in ones); setuptools wrote them sorted by name, which
made ``aws_batch`` every torchx command's default. setup.py keeps the order
pyproject.toml gives, torchx's own.

The installed-package tests read this venv's metadata: after a change to the
entry points, reinstall (``bash scripts/setup.sh --test``).
"""

from __future__ import annotations

import configparser
import re
import sys

import pytest
from torchx.schedulers import DEFAULT_SCHEDULER_MODULES

from tests.aws_batch.conftest import torchx
from tests.conftest import REPO, explain, run

TORCHX_DEFAULT = next(iter(DEFAULT_SCHEDULER_MODULES))  # local_docker in torchx 0.7


@pytest.mark.subprocess  # runs bash / a child python
def test_the_build_writes_the_schedulers_in_torchx_order(tmp_path):
    proc = run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=REPO, timeout=300)
    assert proc.returncode == 0, explain(proc)
    written = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    written.optionxform = str
    written.read(tmp_path / "elastic_ft.egg-info" / "entry_points.txt")
    assert list(written["torchx.schedulers"]) == list(DEFAULT_SCHEDULER_MODULES)
    assert written["torchx.schedulers"]["aws_batch"] == "elastic_ft.aws_batch.scheduler:create_scheduler"
    assert written["torchx.components"]["elastic_ft"] == "elastic_ft.components"
    assert written["console_scripts"]["elastic-ft"] == "elastic_ft.cli:main"


@pytest.mark.torchrun
def test_torchx_run_help_names_torchx_own_default_first():
    proc = torchx("run", "--help")
    assert proc.returncode == 0, explain(proc)
    choices = re.search(r"-s \{([^}]*)\}", proc.stdout)
    assert choices, explain(proc)
    # torchx's help lists the choices in its factories' order; the first is the default.
    assert choices.group(1).split(",") == list(DEFAULT_SCHEDULER_MODULES), explain(proc)


@pytest.mark.torchrun
def test_torchx_run_without_s_plans_for_torchx_own_default():
    proc = torchx("run", "--dryrun", "utils.echo", "--msg", "hi")
    assert proc.returncode == 0, explain(proc)
    assert f"TORCHX_JOB_ID: {TORCHX_DEFAULT}://" in proc.stdout, explain(proc)
