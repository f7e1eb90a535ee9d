"""Pure argument checks: checkpoint URIs, export --out/--step, LoRA target modules."""

import pytest

from elastic_ft.checkpoint.store import UnsupportedURI, check_uri, join_uri, open_store
from elastic_ft.cli import missing_step_problem, out_dir_problem
from elastic_ft.train.model import unmatched_targets


@pytest.mark.parametrize("uri", ["file://", "file:", ""])
def test_file_uri_without_a_path_is_refused(uri):
    # Joined with a run id, these meant '/RUN_ID' at the filesystem root (join_uri('file://', 'r') is 'file:/r').
    assert join_uri(uri or "file://", "run") == "file:/run"
    with pytest.raises(UnsupportedURI, match="has no path"):
        open_store(uri)
    with pytest.raises(UnsupportedURI, match=f"{uri!r} has no path"):
        check_uri(uri)


@pytest.mark.parametrize("uri, path", [("file:///abs/runs", "/abs/runs"), ("file://./runs", "./runs"),
                                       ("runs", "runs"), ("file:///", "/"), ("s3://b/runs", None)])
def test_good_uris_pass(uri, path):
    assert check_uri(uri) == path


def test_missing_step_names_the_committed_steps():
    assert missing_step_problem(4, [2, 4]) is None
    assert missing_step_problem(5, [2, 4, 6]).endswith("committed steps: 2, 4, 6")
    assert "nor at any other step" in missing_step_problem(5, [])
    assert missing_step_problem(1, list(range(2, 40)), shown=3).endswith("(the newest 3 of 38): 37, 38, 39")


def test_out_dir_problems(tmp_path):
    (tmp_path / "empty").mkdir()
    assert out_dir_problem(str(tmp_path / "empty")) is None
    (tmp_path / "f").write_text("x")
    assert out_dir_problem(str(tmp_path / "new" / "dir")) is None
    assert "is an existing file" in out_dir_problem(str(tmp_path / "f"))
    assert "is a file" in out_dir_problem(str(tmp_path / "f" / "sub"))


def test_a_non_empty_out_dir_is_refused_naming_its_files_unless_forced(tmp_path):
    for name in ("adapter_model.safetensors", "notes.txt", "a", "b", "c", "d"):
        (tmp_path / name).write_text("x")
    (tmp_path / "base").mkdir()
    assert out_dir_problem(str(tmp_path)) == (
        f"{str(tmp_path)!r} is not empty (it holds a, adapter_model.safetensors, b, base/, c and 2 more); "
        f"name a new or empty directory, or add --force to write the export among those files "
        f"(replacing any of the same name)")
    assert out_dir_problem(str(tmp_path), force=True) is None


def test_unmatched_targets_follow_peft_suffix_rule():
    names = ["", "model", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"]
    assert unmatched_targets(names, ["q_proj", "self_attn.q_proj", "up_proj"]) == []
    assert unmatched_targets(names, ["q_proj", "proj", "qproj"]) == ["proj", "qproj"]
