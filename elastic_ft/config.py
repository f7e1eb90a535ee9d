"""Job spec: the YAML file that describes a run, mapped onto dataclasses.

Loading is strict: every unknown key, wrong type and out-of-range value is
collected and reported together in one :class:`ConfigError`, each problem
naming its dotted field path and the bad value, and unknown keys suggest the
closest valid name. Command-line overrides (``optimizer.lr=3e-4``) are applied
to the raw mapping before validation so they are checked the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Literal

import yaml

from elastic_ft.bounds import Bound, out_of_range, show_value as _show
# The S3 store's settings are the spec's checkpoint.s3 section; importing them loads no store or boto3.
from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.names import name_problem
from elastic_ft.spec_types import build_dataclass
from elastic_ft.spec_yaml import YamlInputError, load_yaml, read_yaml_file


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
    max_nonfinite_steps: int = 3
    """A step whose gradient norm (or loss) is NaN or infinite skips its update; this many such
    steps in a row stop the run with an error (1 to 1000). Not part of the config hash."""


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
    max_failed_saves: int = 3
    """This many failed saves in a row stop the run with an error naming the last cause (1 to 100)."""
    save_timeout_s: float = 1800.0
    """Longest wait for one save (upload and commit, every rank's part) before the run stops (1 to 86400 s)."""
    s3: S3Options = dataclasses.field(default_factory=S3Options)
    """Settings of an ``s3://`` checkpoint URI's store (SSE, KMS key, part sizes, concurrency, retries,
    timeouts, endpoint, region); unused for ``file://``. Null fields fall back to the environment
    (``ELASTIC_FT_S3_SSE``, ``ELASTIC_FT_S3_SSE_KMS_KEY_ID``, boto3's ``AWS_*``): a value set here wins.
    Never credentials: those come from boto3's chain."""

    def store_settings(self) -> dict[str, dict]:
        """Per-scheme store settings for :func:`elastic_ft.checkpoint.store.open_store`."""
        return {"s3": {"options": self.s3}}


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
        d["optimizer"].pop("max_nonfinite_steps", None)  # a guard's limit, not a training setting
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------- limits

MAX_STEPS = 10**9
"""Steps of a run (and step counts like warm-up and cadence); manifest keys hold 12 digits."""
MAX_BATCH = 2**24
"""Samples in one step; the trainer also refuses more than the dataset holds."""
_MiB, _GiB = 2**20, 2**30


# Every numeric field of the spec, so no input can make the trainer allocate,
# loop or overflow without limit (a billion-sample batch, epochs=1e308).
# Null (where a field allows it) is always accepted. A new numeric field gets a row.
LIMITS: dict[str, Bound] = {
    "data.max_length": Bound(2, 2**17),  # 131072 tokens: the longest contexts models train on
    "lora.r": Bound(1, 2**16),
    "lora.alpha": Bound(1, 2**20),
    "lora.dropout": Bound(0.0, 1.0, hi_open=True),
    "optimizer.lr": Bound(0.0, 10.0, lo_open=True),
    "optimizer.weight_decay": Bound(0.0, 100.0),
    "optimizer.betas": Bound(0.0, 1.0, hi_open=True),
    "optimizer.eps": Bound(0.0, 1.0, lo_open=True),
    "optimizer.warmup_steps": Bound(0, MAX_STEPS),
    "optimizer.min_lr_ratio": Bound(0.0, 1.0),
    "optimizer.grad_clip": Bound(0.0, 1e6, lo_open=True),
    "optimizer.max_nonfinite_steps": Bound(1, 1000),
    "batch.global_batch": Bound(1, MAX_BATCH),
    "batch.micro_batch": Bound(1, MAX_BATCH),
    "batch.reference_world": Bound(1, 2**16),
    "steps": Bound(1, MAX_STEPS),
    "epochs": Bound(0.0, 1e6, lo_open=True),
    "seed": Bound(0, 2**32 - 1),  # numpy's SeedSequence refuses negatives; torch seeds need headroom
    "checkpoint.every_steps": Bound(1, MAX_STEPS),
    "checkpoint.every_seconds": Bound(0.0, 1e8, lo_open=True),
    "checkpoint.keep_last": Bound(1, 10**6),
    "checkpoint.keep_every": Bound(1, MAX_STEPS),
    "checkpoint.orphan_grace_s": Bound(0.0, 1e8),
    "checkpoint.max_failed_saves": Bound(1, 100),
    "checkpoint.save_timeout_s": Bound(1.0, 86400.0),
    # S3's own limits: parts of 5 MiB to 5 GiB, and a single PUT (below the threshold) of 5 GiB at most.
    "checkpoint.s3.multipart_threshold": Bound(5 * _MiB, 5 * _GiB),
    "checkpoint.s3.part_size": Bound(5 * _MiB, 5 * _GiB),
    "checkpoint.s3.download_part_size": Bound(64 * 1024, 5 * _GiB),
    "checkpoint.s3.max_concurrency": Bound(1, 64),
    "checkpoint.s3.max_attempts": Bound(1, 100),
    "checkpoint.s3.backoff_initial": Bound(0.0, 60.0, lo_open=True),
    "checkpoint.s3.backoff_max": Bound(0.0, 3600.0, lo_open=True),
    "checkpoint.s3.connect_timeout": Bound(0.0, 3600.0, lo_open=True),
    "checkpoint.s3.read_timeout": Bound(0.0, 3600.0, lo_open=True),
    "logging.every_steps": Bound(1, MAX_STEPS),
}


# --------------------------------------------------------------------------- parsing


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
    spec.data.files = [f if os.path.isabs(f) or "://" in f else os.path.normpath(os.path.join(base, f))
                       for f in spec.data.files]
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
    if spec.lora is not None:
        need(bool(spec.lora.target_modules), "lora.target_modules", "must name at least one module")
    need(len(o.betas) == 2, "optimizer.betas", f"must be two numbers, got {_show(o.betas)}")
    if b.policy == "scale_with_world" and b.global_batch > 0 and b.reference_world > 0:
        need(b.global_batch % b.reference_world == 0, "batch.global_batch",
             f"must be a multiple of batch.reference_world ({b.reference_world}) for scale_with_world, "
             f"got {b.global_batch}")
    need((spec.steps is None) != (spec.epochs is None), "steps", "set exactly one of steps and epochs")
    problem = name_problem(spec.name) if check_files else None
    need(problem is None, "name", f"{problem} (it is the default run id)")
    need(_only_run_id_placeholder(spec.logging.dir), "logging.dir",
         f"may use only the placeholder {{run_id}}, got {_show(spec.logging.dir)}")
    p.extend(out_of_range(spec, LIMITS))
    reported = {field for field, _ in p}
    # The store's own rules (threshold >= part size, the SSE pair): checked again, with the
    # environment's values, when the store opens; here before any work, naming the field.
    p.extend((f"checkpoint.s3.{field}", msg) for field, msg in spec.checkpoint.s3.problems()
             if f"checkpoint.s3.{field}" not in reported)
    for i, f in enumerate(d.files if check_files else ()):
        need(os.path.isfile(f) or "://" in f, f"data.files[{i}]", f"file {f!r} does not exist")
    return p


def _only_run_id_placeholder(template: str) -> bool:
    # logging.dir is str.format-ed with run_id: any other {field} would raise at start-up.
    try:
        template.format(run_id="x")
    except (KeyError, IndexError, ValueError, AttributeError):
        return False
    return True

