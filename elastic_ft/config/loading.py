"""Reading a job spec: YAML, ``field.path=value`` overrides, and one :class:`ConfigError` for every problem."""

from __future__ import annotations

import json
import os

import yaml

from elastic_ft.config.limits import LIMITS
from elastic_ft.config.sections import JobSpec
from elastic_ft.config.validation import validate
from elastic_ft.config.spec_types import build_dataclass
from elastic_ft.config.spec_yaml import YamlInputError, load_yaml, read_yaml_file


class ConfigError(ValueError):
    """One or more problems in a job spec; ``problems`` holds (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "job spec") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {field}: {msg}" for field, msg in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")



def load_spec(path: str, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a YAML job spec, apply ``key.path=value`` overrides, validate, resolve data paths.

    Every problem with the file itself (missing, a directory, unreadable, not
    UTF-8, too large, bad YAML, aliases expanding too far) is a
    :class:`ConfigError` naming the file.
    """
    try:
        raw = read_yaml_file(path) or {}
    except YamlInputError as exc:
        raise ConfigError([("spec", str(exc))], source=path) from exc
    if not isinstance(raw, dict):
        raise ConfigError([("spec", f"must be a mapping, got {type(raw).__name__}")], source=path)
    return spec_from_dict(raw, overrides=overrides, source=path, base_dir=os.path.dirname(os.path.abspath(path)))


def spec_from_dict(
    raw: dict, overrides: list[str] | tuple[str, ...] = (), source: str = "job spec", base_dir: str | None = None,
    check_files: bool = True,
) -> JobSpec:
    """Build and validate a spec from plain data; relative paths resolve against ``base_dir``.

    ``check_files=False`` is for a spec read back from a checkpoint (export, on
    another machine): it skips the data-file existence check and the check of
    ``name`` as a run id (the run already has its id; older versions allowed
    any name without '/').
    """
    problems: list[tuple[str, str]] = []
    raw = apply_overrides(raw, overrides, problems)
    spec = build_dataclass(JobSpec, raw, problems, limits=LIMITS)
    if spec is not None:
        if base_dir is not None:
            _resolve_paths(spec, base_dir)
        # A field that failed to convert holds its default now: checking that default
        # would add a confusing second problem on the same field.
        reported = {field for field, _ in problems}
        problems.extend(q for q in validate(spec, check_files=check_files) if q[0] not in reported)
    if problems:
        raise ConfigError(problems, source=source)
    assert isinstance(spec, JobSpec)
    return spec


def _resolve_paths(spec: JobSpec, base: str) -> None:
    # Paths in a spec are relative to the spec file, so a spec works from any cwd.
    for attr in ("files", "eval_files"):
        setattr(spec.data, attr, [f if os.path.isabs(f) or "://" in f else os.path.normpath(os.path.join(base, f))
                                  for f in getattr(spec.data, attr)])
    for attr in ("name_or_path", "tokenizer"):
        value = getattr(spec.model, attr)
        if value and value.startswith(("./", "../")):
            setattr(spec.model, attr, os.path.normpath(os.path.join(base, value)))


def apply_overrides(raw: dict, overrides, problems: list[tuple[str, str]]) -> dict:
    """Return a copy of ``raw`` with each ``a.b.c=value`` set (value parsed as YAML).

    A value that is not valid YAML is taken as the plain string; one refused
    by the YAML bounds (aliases expanding too far) is a problem on its key.
    """
    out = _copy_plain(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            shown = item if len(item) <= 80 else f"{item[:60]}..."
            problems.append((shown, "override must look like field.path=value, e.g. optimizer.lr=3e-4"))
            continue
        try:
            value = load_yaml(text)
        except yaml.YAMLError:
            value = text
        except YamlInputError as exc:
            problems.append((key, f"override value is refused: it {exc}"))
            continue
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {} if node.get(p) is None else node[p]
            if not isinstance(node[p], dict):
                problems.append((key, f"cannot set a field inside {p!r}, which is not a mapping"))
                break
            node = node[p]
        else:
            node[parts[-1]] = _copy_plain(value)
    return out


def _copy_plain(value):
    """A deep copy of plain YAML data, aliases written out (setting one field changes one place).

    Keys become strings the way JSON writes them (``1`` -> ``"1"``, ``true`` -> ``"true"``), so
    free-form mappings such as model.config hash and serialise like the JSON they are saved as.
    """
    if isinstance(value, dict):
        return {_key(k): _copy_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_plain(v) for v in value]
    return value


def _key(k) -> str:
    if isinstance(k, str):
        return k
    return json.dumps(k) if k is None or isinstance(k, (bool, int, float)) else str(k)
