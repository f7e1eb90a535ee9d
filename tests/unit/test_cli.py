"""The first hour with ``elastic-ft``: --version, a --help that answers at once, help on every flag,
and ``ckpt ls`` of a location with nothing there."""

import argparse
import os
import subprocess
import sys
import tomllib

import pytest

import elastic_ft
from elastic_ft.cli import build_parser, main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})


@pytest.mark.subprocess
def test_version_prints_the_package_version():
    out = subprocess.run([sys.executable, "-m", "elastic_ft.cli", "--version"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0 and out.stdout == f"elastic-ft {elastic_ft.__version__}\n"
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["version"] == elastic_ft.__version__


@pytest.mark.subprocess
@pytest.mark.parametrize("argv", [[], ["train"], ["ckpt", "ls"], ["export"], ["goodput"], ["events"], ["status"]])
def test_help_does_not_import_torch(argv):
    out = _python(
        "import sys\nfrom elastic_ft.cli import main\n"
        f"try:\n    main({argv + ['--help']!r})\nexcept SystemExit:\n    pass\n"
        "print('heavy:', sorted(m for m in ('torch', 'transformers', 'peft', 'boto3') if m in sys.modules))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "heavy: []"


def _actions(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_and_argument_has_help():
    actions = list(_actions(build_parser(), "elastic-ft"))
    assert len(actions) > 15
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in actions if not a.help]
    assert missing == []


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_ckpt_ls_of_a_location_with_nothing_there_says_so_and_fails(tmp_path, capsys, where):
    run = tmp_path / "r"
    if where == "empty":
        run.mkdir()
    assert main(["ckpt", "ls", f"file://{run}"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1 and f"no committed checkpoints at file://{run}" in out.err


@pytest.mark.parametrize("command", ["events", "status"])
def test_events_and_status_of_a_location_with_nothing_there_say_so_and_fail(tmp_path, capsys, command):
    (tmp_path / "r" / "logs").mkdir(parents=True)  # a run's local log directory is not its events in the store
    assert main([command, f"file://{tmp_path}/r"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1 and f"file://{tmp_path}/r" in out.err and "no events" in out.err
