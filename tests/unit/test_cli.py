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


@pytest.mark.parametrize("head, tail", [
    (["ckpt", "ls"], []), (["ckpt", "verify"], []), (["ckpt", "gc"], ["--dry-run"]), (["events"], []),
    (["status"], []), (["goodput"], []), (["export"], ["--out", "out"]), (["plot"], ["--out", "out.png"]),
])
def test_a_run_uri_with_a_dot_segment_is_refused_before_any_request(tmp_path, capsys, monkeypatch, head, tail):
    # s3://bucket/../x reached the server, whose HTTP 400 read as an endpoint problem.
    monkeypatch.chdir(tmp_path)
    uri = "s3://bucket/../x"
    assert main([*head, uri, *tail]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{uri!r} has a '..' path segment" in err, err


def _committed(root, steps=(2, 4)) -> str:
    """A run location with small committed checkpoints at ``steps``."""
    import torch

    from elastic_ft.checkpoint.local import LocalStore
    from elastic_ft.checkpoint.writer import CheckpointWriter, snapshot

    writer = CheckpointWriter(LocalStore(str(root)), "r")
    for step in steps:
        writer.commit(snapshot(step, step * 4, {"model": {"w": torch.full((3,), float(step))}},
                               documents={"trainer": {"step": step}}, config_hash="h"))
    return f"file://{root}"


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_ckpt_verify_of_a_run_that_is_not_there_is_not_a_corrupt_checkpoint(tmp_path, capsys, where):
    # The README: exit 1 names a corrupt checkpoint, 2 concludes nothing. A run that does not exist exited 1.
    if where == "empty":
        (tmp_path / "r").mkdir()
    uri = f"file://{tmp_path}/r"
    assert main(["ckpt", "verify", uri]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"elastic-ft: error: no committed checkpoints at {uri} to verify "
                                         f"(a run's location is <checkpoint_uri>/<run_id>)\n")


def test_ckpt_verify_of_a_step_that_is_not_there_names_the_steps_and_exits_2(tmp_path, capsys):
    uri = _committed(tmp_path / "r")
    assert main(["ckpt", "verify", uri, "--step", "3"]) == 2
    assert capsys.readouterr().err == (f"elastic-ft: error: ckpt verify --step 3: {uri} has no committed checkpoint "
                                       f"at step 3; its committed steps: 2, 4\n")
    assert main(["ckpt", "verify", uri, "--step", "2"]) == 0
    assert "checkpoint at step 2 OK" in capsys.readouterr().out


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_ckpt_gc_of_a_location_with_nothing_there_says_so_and_exits_1(tmp_path, capsys, dry):
    uri = f"file://{tmp_path}/typo"
    assert main(["ckpt", "gc", uri, *dry]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"elastic-ft: no checkpoints or blobs at {uri}, nothing to collect "
                                         f"(a run's location is <checkpoint_uri>/<run_id>)\n")


def test_ckpt_gc_still_collects_orphans_without_a_manifest(tmp_path, capsys):
    from elastic_ft.checkpoint.local import LocalStore

    LocalStore(str(tmp_path / "r")).put("blobs/000000000002-abcd1234/model.safetensors", b"x")
    assert main(["ckpt", "gc", f"file://{tmp_path}/r", "--grace", "0"]) == 0
    assert "deleted 0 manifest(s) and 1 blob(s)" in capsys.readouterr().out
