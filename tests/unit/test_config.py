"""Job spec loading and validation (elastic_ft.config)."""

import dataclasses
import os
import typing

import pytest
import yaml

from elastic_ft.config import LIMITS, ConfigError, JobSpec, load_spec, spec_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(ROOT, "specs", "tiny-lora.yaml")


def raw_spec() -> dict:
    with open(SPEC) as f:
        return yaml.safe_load(f)


def load(raw: dict, overrides=()) -> JobSpec:
    return spec_from_dict(raw, overrides=overrides, base_dir=os.path.dirname(SPEC))


def _spec_text() -> str:
    """The default spec's text, its data path made absolute (so a copy works from any directory)."""
    with open(SPEC) as f:
        return f.read().replace("../data/", os.path.join(ROOT, "data") + "/")


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def problems_of(raw: dict, overrides=()) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load(raw, overrides)
    return dict(info.value.problems)


def test_default_spec_loads():
    spec = load_spec(SPEC)
    assert spec.name == "tiny-lora"
    assert spec.seed == 1234
    assert spec.model.config["model_type"] == "llama"
    assert spec.model.name_or_path is None
    # relative to the spec file, not the working directory
    assert spec.data.files == [os.path.join(ROOT, "data", "tiny-corpus.jsonl")]
    assert (spec.data.prompt_field, spec.data.response_field, spec.data.max_length) == ("prompt", "response", 48)
    assert spec.lora is not None and spec.lora.r == 8 and "down_proj" in spec.lora.target_modules
    assert spec.optimizer.lr == pytest.approx(6e-3) and "lm_head" in spec.lora.target_modules
    assert spec.optimizer.schedule == "cosine"
    assert (spec.batch.global_batch, spec.batch.micro_batch, spec.batch.policy) == (32, 8, "constant_global")
    assert (spec.steps, spec.epochs) == (100, None)
    assert spec.checkpoint.every_steps == 20 and spec.checkpoint.keep_last == 3
    assert spec.optimizer.weight_decay == 0.0  # unset keys keep their defaults


def test_load_from_another_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert os.path.isfile(load_spec(SPEC).data.files[0])


def test_overrides():
    spec = load_spec(SPEC, ["optimizer.lr=1e-4", "steps=7", "batch.policy=scale_with_world",
                            "lora.target_modules=[q_proj]", "checkpoint.every_seconds=2.5"])
    assert spec.optimizer.lr == pytest.approx(1e-4) and isinstance(spec.optimizer.lr, float)
    assert spec.steps == 7
    assert spec.batch.policy == "scale_with_world"
    assert spec.lora.target_modules == ["q_proj"]
    assert spec.checkpoint.every_seconds == 2.5


def test_scientific_notation_without_dot_in_yaml():
    # YAML 1.1 (PyYAML) reads 1e-4 as a string; the spec must still take it as a float.
    raw = raw_spec()
    raw["optimizer"]["lr"] = "2e-4"
    assert load(raw).optimizer.lr == pytest.approx(2e-4)
    raw["optimizer"]["lr"] = "fast"
    assert "optimizer.lr" in problems_of(raw)


def test_override_creates_nested_new_keys():
    raw = raw_spec()
    del raw["logging"]
    spec = load(raw, ["logging.ledger=true", "model.config.rope_theta=5000.0"])
    assert spec.logging.ledger is True
    assert spec.logging.every_steps == 1  # the rest of the new section keeps defaults
    assert spec.model.config["rope_theta"] == 5000.0
    assert "logging" not in raw  # the caller's mapping is not modified


def test_override_of_unknown_nested_key_is_reported():
    probs = problems_of(raw_spec(), ["optimizer.new_thing.x=1"])
    assert probs["optimizer.new_thing"].startswith("unknown key")


@pytest.mark.parametrize("bad,expected", [
    ("optimizer.lr", "optimizer.lr: override must look like field.path=value"),
    ("=3", "=3: override must look like field.path=value"),
    ("steps.inner=1", "steps.inner: cannot set a field inside 'steps', which is not a mapping"),
])
def test_bad_override_syntax(bad, expected):
    with pytest.raises(ConfigError) as info:
        load_spec(SPEC, [bad])
    assert expected in str(info.value)


def test_unknown_key_suggests_closest_name():
    raw = raw_spec()
    raw["optimiser"] = raw.pop("optimizer")
    raw["batch"]["global_bach"] = raw["batch"].pop("global_batch")
    probs = problems_of(raw)
    assert "did you mean 'optimizer'?" in probs["optimiser"]
    assert "did you mean 'global_batch'?" in probs["batch.global_bach"]


def test_unknown_key_without_close_match_lists_valid_keys():
    raw = raw_spec()
    raw["batch"]["zzzz"] = 1
    assert "valid keys: global_batch, micro_batch" in problems_of(raw)["batch.zzzz"]


def test_all_problems_in_one_error():
    raw = raw_spec()
    raw["optimizer"]["lr"] = -0.5
    raw["batch"]["micro_batch"] = 0
    raw["batch"]["policy"] = "constant"
    raw["seed"] = "abc"
    raw["optimiser"] = {}
    with pytest.raises(ConfigError) as info:
        load(raw)
    probs = dict(info.value.problems)
    assert set(probs) == {"optimizer.lr", "batch.micro_batch", "batch.policy", "seed", "optimiser"}
    assert "-0.5" in probs["optimizer.lr"]
    assert "got 0" in probs["batch.micro_batch"]
    assert "'constant'" in probs["batch.policy"] and "'constant_global'" in probs["batch.policy"]
    assert "must be int" in probs["seed"] and "'abc'" in probs["seed"]
    msg = str(info.value)
    assert "5 problem(s)" in msg
    for field in probs:
        assert f"  - {field}: " in msg


def test_bool_is_not_an_int():
    assert "must be int" in problems_of(raw_spec(), ["batch.global_batch=true"])["batch.global_batch"]


def test_steps_and_epochs_exclusive():
    raw = raw_spec()
    raw["epochs"] = 2
    assert "exactly one of steps and epochs" in problems_of(raw)["steps"]
    raw = raw_spec()
    del raw["steps"]
    assert "exactly one of steps and epochs" in problems_of(raw)["steps"]
    spec = load(raw, ["epochs=1.5"])
    assert (spec.steps, spec.epochs) == (None, 1.5)


def test_missing_data_file_is_named(tmp_path):
    raw = raw_spec()
    raw["data"]["files"] = ["../data/no-such-file.jsonl"]
    probs = problems_of(raw)
    assert "no-such-file.jsonl" in probs["data.files[0]"] and "does not exist" in probs["data.files[0]"]
    spec = spec_from_dict(raw, base_dir=os.path.dirname(SPEC), check_files=False)
    assert spec.data.files[0].endswith("no-such-file.jsonl")


def test_missing_spec_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_spec(os.path.join(ROOT, "specs", "nope.yaml"))


def test_hash_ignores_volatile_fields_but_not_training_ones():
    base = load(raw_spec()).hash()
    assert load(raw_spec(), ["logging.every_steps=3", "logging.ledger=true"]).hash() == base
    assert load(raw_spec(), ["checkpoint.every_steps=5", "checkpoint.keep_last=1"]).hash() == base
    assert load(raw_spec(), ["steps=500"]).hash() == base
    assert load(raw_spec(), ["optimizer.lr=1e-4"]).hash() != base
    assert load(raw_spec(), ["seed=1"]).hash() != base
    assert load(raw_spec(), ["batch.global_batch=16"]).hash() != base


# --------------------------------------------------------------------------- bounds (issue 9, points 5 and 6)


def _fields_of_type(cls, wanted, prefix=""):
    """Dotted paths of every field of ``cls`` (recursively) whose type mentions ``wanted``."""
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        path = f"{prefix}{f.name}"
        if any(dataclasses.is_dataclass(a) for a in inner):
            out += _fields_of_type(next(a for a in inner if dataclasses.is_dataclass(a)), wanted, path + ".")
        elif wanted in inner or any(wanted in typing.get_args(a) for a in inner):
            out.append(path)
    return out


def _base_for(field: str) -> list[str]:
    # epochs needs steps unset (exactly one of the two).
    return ["steps=null"] if field == "epochs" else []


def test_every_numeric_field_has_a_row_in_the_limits_table():
    numeric = set(_fields_of_type(JobSpec, int)) | set(_fields_of_type(JobSpec, float))
    assert numeric <= set(LIMITS), f"fields without a range: {sorted(numeric - set(LIMITS))}"


@pytest.mark.parametrize("field", sorted(LIMITS))
def test_every_numeric_field_is_bounded_both_ways(field):
    bound = LIMITS[field]
    for bad in (bound.hi * 10 + 1, bound.lo - 1):
        value = f"[0.9, {bad}]" if field == "optimizer.betas" else str(bad)
        probs = problems_of(raw_spec(), _base_for(field) + [f"{field}={value}"])
        where = f"{field}[1]" if field == "optimizer.betas" else field
        assert where in probs, (field, bad, probs)
        assert f"must be in {bound}" in probs[where] and str(bad) in probs[where]


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan", "1e999"])
def test_every_float_field_refuses_non_finite_values(text):
    # optimizer.lr=.inf was accepted and trained NaN weights into committed checkpoints.
    fields = _fields_of_type(JobSpec, float)
    assert "optimizer.lr" in fields and "checkpoint.orphan_grace_s" in fields
    for field in fields:
        value = f"[0.9, {text}]" if field == "optimizer.betas" else text
        probs = problems_of(raw_spec(), _base_for(field) + [f"{field}={value}"])
        where = f"{field}[1]" if field == "optimizer.betas" else field
        assert "must be a finite number" in probs.get(where, ""), (field, probs)


def test_huge_numbers_name_the_field_and_the_range():
    probs = problems_of(raw_spec(), ["steps=" + "1" * 100_000])
    assert probs == {"steps": "must be in [1, 1000000000], got <a number 100000 characters long>"}
    probs = problems_of(raw_spec(), ["steps=null", "epochs=1e308"])
    assert probs == {"epochs": "must be in (0.0, 1000000.0], got 1e+308"}
    probs = problems_of(raw_spec(), ["batch.global_batch=1000000000", "seed=-1"])
    assert "must be in [1, 16777216]" in probs["batch.global_batch"]
    assert "must be in [0, 4294967295]" in probs["seed"]
    # a hexadecimal number converts without Python's digit limit, and must not become a huge int
    assert "got <a number 10002 characters long>" in problems_of(raw_spec(), ["steps=0x" + "f" * 10_000])["steps"]
    # inside a free-form mapping too
    assert "model.config.hidden_size" in problems_of(raw_spec(), ["model.config.hidden_size=" + "9" * 5000])


def test_huge_number_in_a_spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(_spec_text().replace("steps: 100", "steps: " + "7" * 100_000))
    with pytest.raises(ConfigError) as info:
        load_spec(str(path))
    assert dict(info.value.problems) == {"steps": "must be in [1, 1000000000], got <a number 100000 characters long>"}


def test_long_bad_values_are_shortened_in_errors():
    probs = problems_of(raw_spec(), ["batch.policy=" + "z" * 100_000, "data.max_length=" + "x" * 100_000])
    assert all(len(msg) < 300 for msg in probs.values()), probs


# --------------------------------------------------------------------------- YAML aliases and shape


def _alias_bomb(levels: int = 7) -> str:
    """A "billion laughs": each level lists the previous one nine times (9**levels strings).

    Seven levels (4.8 million strings) keep the old code's expansion to a few hundred MB
    should these tests run against it; nine took 8 GB."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines)


def _bounded(fn):
    """Run ``fn``; return its ConfigError message, checking it failed quickly and in little memory."""
    import time
    import tracemalloc

    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError) as info:
            fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - start < 5 and peak < 50 * 2**20, (time.monotonic() - start, peak)
    return str(info.value)


def test_alias_bomb_in_an_override_is_refused_quickly():
    # apply_overrides expanded this to 8 GB over 149 s, then raised MemoryError.
    flow = "{" + _alias_bomb().replace("\n", ", ") + "}"
    message = _bounded(lambda: load_spec(SPEC, [f"model.config.x={flow}"]))
    assert "model.config.x: override value is refused: it aliases (*name) expand it to more than 10,000" in message


def test_alias_bomb_in_a_spec_file_is_refused_quickly(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_spec_text().replace("  model_type: llama", "  model_type: llama\n    " +
                                             _alias_bomb().replace("\n", "\n    ")))
    message = _bounded(lambda: load_spec(str(path)))
    assert f"spec: file {str(path)!r} is refused: it aliases (*name) expand it" in message


def test_small_aliases_still_work(tmp_path):
    path = tmp_path / "alias.yaml"
    text = _spec_text().replace("seed: 1234", "seed: &s 1234").replace("steps: 100", "steps: *s")
    assert load_spec(_write(path, text)).steps == 1234
    spec = load_spec(SPEC, ["model.config={model_type: llama, a: &v [1, 2], b: *v}"])
    assert spec.model.config["b"] == [1, 2]


@pytest.mark.parametrize("value,expected", [
    ("&a [*a]", "refers to a value that contains it"),
    ("[" * 100 + "]" * 100, "nested more than 64 levels deep"),
    ("[" * 5000 + "]" * 5000, "nested more than 64 levels deep"),
])
def test_recursive_or_deep_values_are_refused(value, expected):
    assert expected in problems_of(raw_spec(), [f"model.config.x={value}"])["model.config.x"]


def test_config_keys_are_strings_as_in_the_saved_json():
    spec = load(raw_spec(), ["model.config.id2label={0: neg, 1: pos}"])
    assert spec.model.config["id2label"] == {"0": "neg", "1": "pos"}
    assert spec.hash()


def _lines_of(text: str, line: str) -> list[int]:
    return [n for n, got in enumerate(text.splitlines(), 1) if got == line]


@pytest.mark.parametrize("edit,key,first,second", [
    # a second optimizer block after the first: PyYAML kept only the second
    (lambda t: t + "optimizer:\n  lr: 1.0e-4\n", "optimizer", "optimizer:", "optimizer:"),
    (lambda t: t.replace("steps: 100", "steps: 100\nsteps: 7"), "steps", "steps: 100", "steps: 7"),
    # at depth, and spelled with quotes: still the same key
    (lambda t: t.replace("  warmup_steps: 5", "  warmup_steps: 5\n  'warmup_steps': 9"), "optimizer.warmup_steps",
     "  warmup_steps: 5", "  'warmup_steps': 9"),
    (lambda t: t.replace("    hidden_size: 64", "    hidden_size: 64\n    hidden_size: 32"), "model.config.hidden_size",
     "    hidden_size: 64", "    hidden_size: 32"),
])
def test_duplicate_keys_in_a_spec_file_are_refused_with_both_lines(tmp_path, edit, key, first, second):
    text = edit(_spec_text())
    lines = (_lines_of(text, first)[0], _lines_of(text, second)[-1])
    assert lines[0] < lines[1]
    path = _write(tmp_path / "dup.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    assert info.value.problems == [("spec", f"file {path!r} is refused: it gives key {key!r} twice "
                                            f"(lines {lines[0]} and {lines[1]}); the second would silently "
                                            f"replace the first: give it once")]


def test_duplicate_keys_in_an_override_value_are_refused():
    problems = problems_of(raw_spec(), ["model.config.x={a: 1, b: {c: 2, c: 3}}"])
    assert problems == {"model.config.x": "override value is refused: it gives key 'b.c' twice (twice on line 1); "
                                          "the second would silently replace the first: give it once"}


def test_merge_keys_may_still_be_overridden(tmp_path):
    # "<<: *base" then the same key: overriding a merged value is what merging is for, not a duplicate
    spec = load_spec(SPEC, ["model.config={model_type: llama, base: &b {x: 1, y: 2}, c: {<<: *b, x: 3}}"])
    assert spec.model.config["c"] == {"x": 3, "y": 2}


# --------------------------------------------------------------------------- the spec file itself


def test_spec_that_is_a_directory(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_spec(str(tmp_path))
    assert info.value.problems == [("spec", f"file {str(tmp_path)!r} is a directory; give the path of a YAML file, "
                                            f"e.g. specs/tiny-lora.yaml")]


def test_spec_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_spec(str(path))
    assert info.value.problems == [("spec", f"file {str(path)!r} is not UTF-8 text (byte 0xe9 at offset 9); "
                                            f"a job spec is YAML text")]


def test_spec_too_large(tmp_path, monkeypatch):
    from elastic_ft.config import spec_yaml

    monkeypatch.setattr(spec_yaml, "MAX_FILE_BYTES", 100)
    with pytest.raises(ConfigError, match="is larger than"):
        load_spec(SPEC)


# --------------------------------------------------------------------------- names (issue 9, point 4)


@pytest.mark.parametrize("name", ["..", ".", "../escaped", "a/b", "x" * 300, ""])
def test_job_name_must_be_a_safe_run_id(name):
    # The name is the default run id: 'name: ..' wrote outside checkpoint_uri; 300 characters failed at the first save.
    raw = raw_spec()
    raw["name"] = name
    assert "(it is the default run id)" in problems_of(raw)["name"]


def test_stored_spec_of_an_older_run_keeps_its_name():
    # A checkpoint's spec (export reads it with check_files=False) was written when any name without '/' was allowed.
    raw = raw_spec()
    raw["name"] = "my old job"
    assert spec_from_dict(raw, base_dir=os.path.dirname(SPEC), check_files=False).name == "my old job"


def test_logging_dir_may_only_use_the_run_id_placeholder():
    assert load(raw_spec(), ["logging.dir=logs/{run_id}/x"]).logging.dir == "logs/{run_id}/x"
    for bad in ("logs/{run}", "logs/{0}", "logs/{"):
        assert "placeholder {run_id}" in problems_of(raw_spec(), [f"logging.dir='{bad}'"])["logging.dir"]
