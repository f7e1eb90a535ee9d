"""Run ids and job names (elastic_ft.config.names): one path component, bounded length."""

import pytest

from elastic_ft.config.names import MAX_NAME_LENGTH, InvalidName, check_name, name_problem


@pytest.mark.parametrize("name", ["a", "tiny-lora", "run.2026-01-01_a", "0" * MAX_NAME_LENGTH, "A..B"])
def test_valid_names(name):
    assert name_problem(name) is None
    assert check_name(name, "--run_id") == name


@pytest.mark.parametrize("name,expected", [
    ("..", "must use only letters"),
    (".", "must use only letters"),
    ("../escaped", "got '../escaped'"),
    ("a/b", "must use only letters"),
    ("a\\b", "must use only letters"),
    ("_x", "starting with a letter or digit"),
    ("x\n", "must use only letters"),
    ("", "must be a non-empty name"),
    (None, "must be a non-empty name"),
    (3, "must be a non-empty name"),
    ("x" * (MAX_NAME_LENGTH + 1), f"is {MAX_NAME_LENGTH + 1} characters long; the limit is {MAX_NAME_LENGTH}"),
])
def test_invalid_names(name, expected):
    assert expected in name_problem(name)
    with pytest.raises(InvalidName, match="^name "):
        check_name(name, "name")


def test_a_huge_name_is_not_echoed_whole():
    problem = name_problem("y" * 1_000_000)
    assert "1000000 characters" in problem and len(problem) < 300
