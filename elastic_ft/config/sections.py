"""The job spec's sections, one dataclass each; :class:`JobSpec` holds them all.

Every field has a docstring (the spec's reference); its bounds are in
:mod:`elastic_ft.config.limits`, its cross-field rules in
:mod:`elastic_ft.config.validation`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Literal

# The S3 store's settings are the spec's checkpoint.s3 section; importing them loads no store or boto3.
from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.inputs.settings import InputsConfig


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    name_or_path: str | None = None
    """A local model directory, a hub name (``AutoModelForCausalLM.from_pretrained``), or an
    ``s3://bucket/prefix/`` holding the directory's files, fetched into each node's input cache."""
    config: dict | None = None
    """Inline ``transformers`` config (with ``model_type``) for a from-scratch model, initialised from ``seed``."""
    tokenizer: str | None = None
    """Tokenizer directory, hub name or ``s3://bucket/prefix/``; default: ``name_or_path``, or the built-in
    byte tokenizer for inline configs."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Legacy: casts the *whole* model (trainable weights and optimizer state too) to this dtype. Prefer the
    ``precision`` section, which keeps trainable weights and optimizer state in float32; the two cannot be
    combined."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (non-reentrant
    ``torch.utils.checkpoint``, works with LoRA): less activation memory for about one more forward pass.
    The same loss and gradients; not part of the config hash."""
    loss_chunk_tokens: int | None = None
    """Compute the loss through the output layer this many tokens at a time (1 to 16777216), each chunk's
    float32 logits recomputed in the backward pass, so neither pass holds the whole micro-batch's
    full-vocabulary logits (at a 128k vocabulary they are 0.5 MB per token). About one more output-layer
    matmul per step; the same loss and gradients. Null: the whole logits at once. Not part of the config hash."""


@dataclasses.dataclass(kw_only=True)
class PrecisionConfig:
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the frozen (base) weights. Trainable weights (LoRA adapters, or every weight of a full
    fine-tune) and their optimizer state stay float32, and checkpoints store them so."""
    compute: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the forward and backward matmuls (``torch.autocast``); float32 turns autocast off. Must be
    bfloat16 when ``param_dtype`` is lower than float32. (float16 compute would need loss scaling: not offered.)"""


@dataclasses.dataclass(kw_only=True)
class ParallelismConfig:
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the model is spread over the ranks: ``ddp`` (a full replica per rank, gradients all-reduced), or
    ``fsdp`` (FSDP2: parameters, gradients and optimizer state sharded over the ranks, each decoder layer
    all-gathered as it runs; for a full fine-tune, or LoRA on a base that does not fit one device).
    Checkpoints of an fsdp run are sharded and load at any world size; either strategy resumes the other's
    checkpoints. Not part of the config hash."""
    shard_size: int | None = None
    """fsdp only: shard within groups of this many ranks and replicate across the groups (hybrid sharding, a
    2-D mesh; e.g. the GPUs of one node, so the all-gathers stay on the node's links). Every world the job
    runs at must be a multiple of it, checked at every restart. Null: shard over the whole world."""


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    files: list[str] = dataclasses.field(default_factory=list)
    """json/jsonl/parquet/text files: local paths (relative ones resolved against the spec file's directory)
    or ``s3://bucket/key`` objects, fetched into each node's input cache (see ``inputs``)."""
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
    """Tokens per sample (longer samples are truncated); with packing, also the length of a packed row."""
    packing: bool = False
    """Pack whole samples into rows of ``max_length`` tokens (best-fit decreasing, once when the token store is
    built): position ids restart at each sample and attention never crosses a sample boundary. The cursor
    then deals packed rows: ``batch`` sizes and ``steps`` count rows, as TRL counts packed sequences."""


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
    local_cache_dir: str | None = None
    """A node-local directory keeping the blobs of the last checkpoints this node wrote or loaded (per run
    id); a restarted worker reads a blob from it when its size and digest match the manifest, and from the
    store otherwise. Null: off (every load reads the store)."""
    s3: S3Options = dataclasses.field(default_factory=S3Options)
    """Settings of an ``s3://`` checkpoint URI's store (SSE, KMS key, part sizes, concurrency, retries,
    timeouts, endpoint, region); unused for ``file://``. Null fields fall back to the environment
    (``ELASTIC_FT_S3_SSE``, ``ELASTIC_FT_S3_SSE_KMS_KEY_ID``, boto3's ``AWS_*``): a value set here wins.
    Never credentials: those come from boto3's chain."""

    def store_settings(self) -> dict[str, dict]:
        """Per-scheme store settings for :func:`elastic_ft.checkpoint.store.open_store`."""
        return {"s3": {"options": self.s3}}


@dataclasses.dataclass(kw_only=True)
class SpotConfig:
    enabled: bool = True
    """Watch for spot notices (IMDS, SIGTERM) and commit and leave on one; false: a notice is a crash."""
    poll_interval_s: float = 1.0
    """Seconds between IMDS polls on each worker's watcher thread (0.1 to 60; AWS suggests every 5 s). Every
    second of it delays a leave, for which the other nodes wait; a poll (a cached token, two local GETs)
    costs about 0.6 ms of one core's time."""
    imds_timeout_s: float = 1.0
    """Timeout of one IMDS request (0.05 to 30 s); the endpoint is ELASTIC_FT_IMDS_ENDPOINT."""
    token_ttl_s: int = 21600
    """Lifetime asked for the IMDSv2 session token (1 to 21600 s, IMDS's own limits)."""
    on_rebalance: Literal["checkpoint", "ignore"] = "checkpoint"
    """A rebalance recommendation: commit a checkpoint early (and keep training), or ignore it."""
    sigterm: bool = True
    """Treat SIGTERM to a worker as a notice (commit and leave) instead of dying at once."""
    sigterm_grace_s: float = 30.0
    """The deadline assumed after SIGTERM (torchrun and Batch SIGKILL 30 s after it; 1 to 3600 s)."""
    sigterm_boundary_s: float = 10.0
    """Longest wait after SIGTERM (or after the last step boundary since) for a step boundary, or two of the
    last step's duration if longer; then the worker exits as SIGTERM would have, so a collective stuck on a
    lost peer does not hold its agent up until the SIGKILL (1 to 3600 s)."""
    train_until_deadline: bool = False
    """On a notice with a known deadline, keep training while another step and a commit still fit."""
    margin_s: float = 10.0
    """Seconds kept in hand before the deadline with train_until_deadline (0 to 3600)."""
    collective_timeout_s: float = 600.0
    """How long a collective (and the process group's start) waits for a peer before it fails (10 to 86400 s;
    applies whether or not ``enabled``). A backstop: the etcd3 agents notice a lost or silent node by its
    keep-alive within seconds and restart the workers; this bounds a wait they cannot see, a worker hung on
    a node whose agent is alive (torch's default for gloo is 30 minutes). It must exceed the longest time
    one rank legitimately waits for another in the training process group: at a resume the others wait in
    a broadcast while the leader downloads and verifies the checkpoint, so raise it for checkpoints of many
    GB on slow storage. (Background saves have their own group, bounded by checkpoint.save_timeout_s.)"""


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    dir: str | None = None
    """Directory of events.jsonl; ``{run_id}`` is substituted; relative to the working directory. Null: the
    run's directory's ``logs/`` for a ``file://`` checkpoint URI (``<path>/<run_id>/logs``), else (``s3://``)
    ``$XDG_CACHE_HOME/elastic_ft/runs/<run_id>/logs`` (``~/.cache/...``). ``--log_dir`` overrides it."""
    every_steps: int = 1
    """Progress line every N steps."""
    ledger: bool = False
    """Log the sample ids of every step as events, to prove exactly-once consumption."""
    tensorboard: bool = False
    """Also write the step metrics (loss, lr, tokens/s, world), checkpoints, rescales and preemptions for
    TensorBoard, from the leader, into ``<events dir>/tensorboard`` (the ``tensorboard`` extra:
    ``pip install 'elastic-ft[tensorboard]'``)."""


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
    spot: SpotConfig = dataclasses.field(default_factory=SpotConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    """Mixed precision: the dtype of frozen weights and of compute (trainable state stays float32)."""
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    inputs: InputsConfig = dataclasses.field(default_factory=InputsConfig)
    """Where each node caches the ``s3://`` data files and model directories it fetches, and their bounds."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable hash of what determines the training result (not logging or checkpoint cadence)."""
        d = self.to_dict()
        # Cadence, logging and run length may change between restarts (extend a run
        # with steps=...) without making the checkpoint a different training.
        for volatile in ("logging", "checkpoint", "spot", "inputs", "name", "steps", "epochs"):
            d.pop(volatile, None)
        d["optimizer"].pop("max_nonfinite_steps", None)  # a guard's limit, not a training setting
        d["model"].pop("gradient_checkpointing", None)  # recomputes the same activations
        d["model"].pop("loss_chunk_tokens", None)  # the same loss, summed by chunks
        d.pop("parallelism", None)  # where the state lives, not what is computed (up to the order of float sums)
        # Sections added later hash as before while at their defaults: older runs keep their hash.
        for section, cls in (("precision", PrecisionConfig),):
            if d.get(section) == dataclasses.asdict(cls()):
                d.pop(section)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
