"""File modes of what we write: the umask's, not a temporary file's 0600."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from elastic_ft.checkpoint.filemode import FileTree, current_umask, default_file_mode


@pytest.fixture
def umask():
    """Set the process umask for one test, restoring it after."""
    saved = os.umask(0o022)
    os.umask(saved)

    def set_(mask: int) -> None:
        os.umask(mask)

    yield set_
    os.umask(saved)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_umask_is_read_without_changing_it(umask, mask):
    umask(mask)
    assert current_umask() == mask
    assert default_file_mode() == 0o666 & ~mask
    assert current_umask() == mask


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_files_written_by_a_library_get_the_umask_mode_and_others_keep_theirs(tmp_path, umask, mask):
    umask(mask)
    (tmp_path / "sub").mkdir()
    mine = tmp_path / "notes.txt"
    mine.write_text("the user's file")
    os.chmod(mine, 0o640)
    rewritten = tmp_path / "config.json"
    rewritten.write_text("{}")
    os.chmod(rewritten, 0o600)
    before = FileTree.of(str(tmp_path))
    # safetensors writes through a 0600 temporary file whatever the umask: the case being fixed.
    save_file({"w": torch.zeros(4)}, str(tmp_path / "sub" / "model.safetensors"))
    assert _mode(tmp_path / "sub" / "model.safetensors") == 0o600
    with open(rewritten, "w") as f:
        f.write('{"a": 1}')
    written = before.apply_umask_to_written()
    assert sorted(written) == sorted([str(tmp_path / "sub" / "model.safetensors"), str(rewritten)])
    assert _mode(tmp_path / "sub" / "model.safetensors") == 0o666 & ~mask
    assert _mode(rewritten) == 0o666 & ~mask
    assert _mode(mine) == 0o640
