"""Job spec: the YAML file that describes a run, mapped onto dataclasses.

Loading is strict: every unknown key, wrong type and out-of-range value is
collected and reported together in one :class:`ConfigError`, each problem
naming its dotted field path and the bad value, and unknown keys suggest the
closest valid name. Command-line overrides (``optimizer.lr=3e-4``) are applied
to the raw mapping before validation so they are checked the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
import types
import typing
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """One or more problems in a job spec; ``problems`` holds (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "job spec") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {field}: {msg}" for field, msg in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    name_or_path: str | None = None
    """A local model directory or a hub name (``AutoModelForCausalLM.from_pretrained``)."""
    config: dict | None = None
    """Inline ``transformers`` config (with ``model_type``) for a from-scratch model, initialised from ``seed``."""
    tokenizer: str | None = None
    """Tokenizer directory or hub name; default: ``name_or_path``, or the built-in byte tokenizer for inline configs."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the base model."""


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    files: list[str] = dataclasses.field(default_factory=list)
    """Local json/jsonl/parquet/text files; relative paths are resolved against the spec file's directory."""
    dataset: str | None = None
    """A hub dataset name for ``datasets.load_dataset`` (instead of ``files``)."""
    split: str = "train"
    """Dataset split to train on."""
    format: Literal["json", "parquet", "text"] | None = None
    """File format; inferred from the first file's extension when unset."""
    text_field: str = "text"
    """Field holding the training text (when prompt/response fields are unset)."""
    prompt_field: str | None = None
    """Field holding the prompt; with ``response_field`` the loss covers the response only."""
    response_field: str | None = None
    """Field holding the response."""
    max_length: int = 128
    """Tokens per sample (longer texts are truncated; with packing, the block size)."""
    packing: bool = False
    """Concatenate texts and cut them into ``max_length`` blocks (no padding)."""


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    r: int = 8
    """LoRA rank."""
    alpha: int = 16
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["q_proj", "v_proj"])
    """Module names to adapt."""


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    lr: float = 1e-3
    """Peak learning rate of AdamW (at the reference world for ``scale_with_world``)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to ``lr``."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of the peak."""
    grad_clip: float | None = 1.0
    """Max global gradient norm; null disables clipping."""


@dataclasses.dataclass(kw_only=True)
class BatchConfig:
    global_batch: int = 16
    """Samples per optimizer step (for ``scale_with_world``: at ``reference_world``)."""
    micro_batch: int = 4
    """Max samples per forward/backward on one rank; more are accumulated."""
    policy: Literal["constant_global", "scale_with_world"] = "constant_global"
    """How batch and LR follow the world size (see DESIGN.md, Batch and LR)."""
    lr_scaling: Literal["linear", "sqrt"] = "linear"
    """LR rule for ``scale_with_world``: lr * (world/reference_world) or its square root."""
    reference_world: int = 1
    """World size at which ``global_batch`` and ``lr`` are stated (``scale_with_world``)."""


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    every_steps: int | None = 10
    """Commit a checkpoint every N steps (null: never by steps)."""
    every_seconds: float | None = None
    """Commit a checkpoint when this long has passed since the last one (null: never by time)."""
    keep_last: int | None = 3
    """Committed checkpoints to keep (null: keep all)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (null: none extra)."""
    orphan_grace_s: float = 3600.0
    """Blobs no manifest references are deleted once older than this (a save in flight is younger)."""
    save_final: bool = True
    """Commit a checkpoint at the last step."""
    async_save: bool = True
    """Upload in the background (training blocks only for the copy to host memory)."""
    if_busy: Literal["wait", "skip"] = "wait"
    """When a save is due while the previous one is still uploading: wait for it, or skip this one."""


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    dir: str = "runs/{run_id}/logs"
    """Directory of events.jsonl; ``{run_id}`` is substituted; relative to the working directory."""
    every_steps: int = 1
    """Progress line every N steps."""
    ledger: bool = False
    """Log the sample ids of every step as events, to prove exactly-once consumption."""


@dataclasses.dataclass(kw_only=True)
class JobSpec:
    name: str = "job"
    """The job's name; also the default run id."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    lora: LoraConfig | None = dataclasses.field(default_factory=LoraConfig)
    """LoRA settings; null means a full fine-tune."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    steps: int | None = None
    """Optimizer steps to train (or set ``epochs``)."""
    epochs: float | None = None
    """Passes over the data (used when ``steps`` is null)."""
    seed: int = 0
    """Seed for model init and the data order."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable hash of what determines the training result (not logging or checkpoint cadence)."""
        d = self.to_dict()
        # Cadence, logging and run length may change between restarts (extend a run
        # with steps=...) without making the checkpoint a different training.
        for volatile in ("logging", "checkpoint", "name", "steps", "epochs"):
            d.pop(volatile, None)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------- parsing


def load_spec(path: str, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a YAML job spec, apply ``key.path=value`` overrides, validate, resolve data paths."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError as exc:
        raise ConfigError([("spec", f"file {path!r} does not exist")], source=path) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([("spec", f"is not valid YAML: {exc}")], source=path) from exc
    if not isinstance(raw, dict):
        raise ConfigError([("spec", f"must be a mapping, got {type(raw).__name__}")], source=path)
    return spec_from_dict(raw, overrides=overrides, source=path, base_dir=os.path.dirname(os.path.abspath(path)))


def spec_from_dict(
    raw: dict, overrides: list[str] | tuple[str, ...] = (), source: str = "job spec", base_dir: str | None = None,
    check_files: bool = True,
) -> JobSpec:
    """Build and validate a spec from plain data; relative paths resolve against ``base_dir``.

    ``check_files=False`` skips the data-file existence check (a spec read back
    from a checkpoint on another machine, for export).
    """
    problems: list[tuple[str, str]] = []
    raw = apply_overrides(raw, overrides, problems)
    spec = _build(JobSpec, raw, "", problems)
    if spec is not None:
        if base_dir is not None:
            _resolve_paths(spec, base_dir)
        problems.extend(validate(spec, check_files=check_files))
    if problems:
        raise ConfigError(problems, source=source)
    assert isinstance(spec, JobSpec)
    return spec


def _resolve_paths(spec: JobSpec, base: str) -> None:
    # Paths in a spec are relative to the spec file, so a spec works from any cwd.
    spec.data.files = [f if os.path.isabs(f) or "://" in f else os.path.normpath(os.path.join(base, f))
                       for f in spec.data.files]
    for attr in ("name_or_path", "tokenizer"):
        value = getattr(spec.model, attr)
        if value and value.startswith(("./", "../")):
            setattr(spec.model, attr, os.path.normpath(os.path.join(base, value)))


def apply_overrides(raw: dict, overrides, problems: list[tuple[str, str]]) -> dict:
    """Return a copy of ``raw`` with each ``a.b.c=value`` set (value parsed as YAML)."""
    out = json.loads(json.dumps(raw))  # deep copy of plain YAML data
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            problems.append((item, "override must look like field.path=value, e.g. optimizer.lr=3e-4"))
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
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
            node[parts[-1]] = value
    return out


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _build(cls, raw: Any, path: str, problems: list[tuple[str, str]]):
    if not isinstance(raw, dict):
        problems.append((path or "spec", f"must be a mapping, got {raw!r}"))
        return None
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    kwargs = {}
    for key, value in raw.items():
        fpath = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(fields)}"
            problems.append((fpath, f"unknown key{hint}"))
            continue
        ok, converted = _convert(hints[key], value, fpath, problems)
        if ok:
            kwargs[key] = converted
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - all fields have defaults
        problems.append((path or "spec", str(exc)))
        return None


_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _convert(tp, value, path: str, problems) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return True, None
        if len(args) == 1:
            return _convert(args[0], value, path, problems)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return True, value
        problems.append((path, f"{value!r} is not one of {', '.join(map(repr, allowed))}"))
        return False, None
    if dataclasses.is_dataclass(tp):
        built = _build(tp, value, path, problems)
        return built is not None, built
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append((path, f"must be a list, got {value!r}"))
            return False, None
        items = []
        for i, v in enumerate(value):
            ok, c = _convert(item_tp, v, f"{path}[{i}]", problems)
            if not ok:
                return False, None
            items.append(c)
        return True, items
    if tp is dict:
        if isinstance(value, dict):
            return True, value
        problems.append((path, f"must be a mapping, got {value!r}"))
        return False, None
    if tp is bool:
        if isinstance(value, bool):
            return True, value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        # PyYAML follows YAML 1.1, which reads 1e-4 (no dot) as a string; accept it as a number.
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return True, float(value)
    elif tp is str:
        if isinstance(value, str):
            return True, value
    problems.append((path, f"must be {getattr(tp, '__name__', tp)}, got {value!r}"))
    return False, None


# --------------------------------------------------------------------------- validation


def validate(spec: JobSpec, *, check_files: bool = True) -> list[tuple[str, str]]:
    """Range and consistency checks that types alone cannot express."""
    p: list[tuple[str, str]] = []

    def need(cond: bool, field: str, msg: str) -> None:
        if not cond:
            p.append((field, msg))

    m, d, o, b = spec.model, spec.data, spec.optimizer, spec.batch
    need(bool(m.name_or_path) != bool(m.config), "model",
         "set exactly one of model.name_or_path and model.config")
    if m.config is not None:
        need("model_type" in m.config, "model.config.model_type", "is required (e.g. llama)")
    need(bool(d.files) != bool(d.dataset), "data", "set exactly one of data.files and data.dataset")
    need((d.prompt_field is None) == (d.response_field is None), "data.response_field",
         "prompt_field and response_field must be set together")
    need(d.max_length >= 2, "data.max_length", f"must be at least 2, got {d.max_length}")
    if spec.lora is not None:
        need(spec.lora.r > 0, "lora.r", f"must be positive, got {spec.lora.r}")
        need(spec.lora.alpha > 0, "lora.alpha", f"must be positive, got {spec.lora.alpha}")
        need(0.0 <= spec.lora.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {spec.lora.dropout}")
        need(bool(spec.lora.target_modules), "lora.target_modules", "must name at least one module")
    need(o.lr > 0, "optimizer.lr", f"must be positive, got {o.lr}")
    need(o.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")
    need(len(o.betas) == 2 and all(0 <= x < 1 for x in o.betas), "optimizer.betas",
         f"must be two numbers in [0, 1), got {o.betas}")
    need(o.eps > 0, "optimizer.eps", f"must be positive, got {o.eps}")
    need(o.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    need(0.0 <= o.min_lr_ratio <= 1.0, "optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    need(o.grad_clip is None or o.grad_clip > 0, "optimizer.grad_clip", f"must be positive or null, got {o.grad_clip}")
    need(b.global_batch > 0, "batch.global_batch", f"must be positive, got {b.global_batch}")
    need(b.micro_batch > 0, "batch.micro_batch", f"must be positive, got {b.micro_batch}")
    need(b.reference_world > 0, "batch.reference_world", f"must be positive, got {b.reference_world}")
    if b.policy == "scale_with_world" and b.global_batch > 0 and b.reference_world > 0:
        need(b.global_batch % b.reference_world == 0, "batch.global_batch",
             f"must be a multiple of batch.reference_world ({b.reference_world}) for scale_with_world, "
             f"got {b.global_batch}")
    need((spec.steps is None) != (spec.epochs is None), "steps", "set exactly one of steps and epochs")
    need(spec.steps is None or spec.steps > 0, "steps", f"must be positive, got {spec.steps}")
    need(spec.epochs is None or spec.epochs > 0, "epochs", f"must be positive, got {spec.epochs}")
    c = spec.checkpoint
    need(c.every_steps is None or c.every_steps > 0, "checkpoint.every_steps", f"must be positive or null, got {c.every_steps}")
    need(c.every_seconds is None or c.every_seconds > 0, "checkpoint.every_seconds",
         f"must be positive or null, got {c.every_seconds}")
    need(c.keep_last is None or c.keep_last > 0, "checkpoint.keep_last", f"must be positive or null, got {c.keep_last}")
    need(c.keep_every is None or c.keep_every > 0, "checkpoint.keep_every", f"must be positive or null, got {c.keep_every}")
    need(c.orphan_grace_s >= 0, "checkpoint.orphan_grace_s", f"must be >= 0, got {c.orphan_grace_s}")
    need(spec.logging.every_steps > 0, "logging.every_steps", f"must be positive, got {spec.logging.every_steps}")
    need(bool(spec.name) and "/" not in spec.name, "name", f"must be a non-empty name without '/', got {spec.name!r}")
    for i, f in enumerate(d.files if check_files else ()):
        need(os.path.isfile(f) or "://" in f, f"data.files[{i}]", f"file {f!r} does not exist")
    return p
