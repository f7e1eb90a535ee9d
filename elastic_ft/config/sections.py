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
class QuantizationConfig:
    load_in_4bit: bool = False
    """Q-LoRA: load the frozen base's decoder-layer Linear weights in 4 bits (bitsandbytes' ``Linear4bit``, via
    transformers' ``BitsAndBytesConfig``; the ``qlora`` extra: ``pip install 'elastic-ft[qlora]'``). About a
    quarter of their bfloat16 bytes; the embeddings, norms and output layer stay in ``precision.param_dtype``.
    Needs a ``lora`` section (4-bit weights are not trained); ``parallelism.strategy: fsdp`` shards the 4-bit
    weights (stored as bfloat16 for it, bitsandbytes' ``quant_storage``) after each rank loads them. Quantizing is
    deterministic (the same base gives the same bytes on every worker) and the 4-bit weights are never
    checkpointed: each (re)started worker quantizes the base again as it loads it."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """The 4-bit data type: ``nf4`` (NormalFloat, the Q-LoRA paper's, for normally distributed weights) or ``fp4``."""
    double_quant: bool = True
    """Quantize the per-block scales too (8-bit, blocks of 256): about 0.37 bits less per weight (0.4 GB on an 8B
    model) for a little dequantization time."""
    compute_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """The dtype 4-bit weights are dequantized to for each matmul (and the dtype of the ``--merge`` export's
    dequantized copy). bfloat16 as in the Q-LoRA paper; float32 costs twice the temporary and the time."""


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
    messages_field: str | None = None
    """Field holding a conversation (chat data): a list of ``{"role", "content"}`` messages, roles system, user,
    assistant or tool, as in the OpenAI and Hugging Face chat format. Rendered with the tokenizer's chat
    template; the loss covers the assistant turns only (their content and end-of-turn token, not their role
    header). Cannot be combined with ``text_field``, ``prompt_field`` or ``response_field``."""
    max_length: int = 128
    """Tokens per sample (longer samples are truncated); with packing, also the length of a packed row."""
    packing: bool = False
    """Pack whole samples into rows of ``max_length`` tokens (best-fit decreasing, once when the token store is
    built): position ids restart at each sample and attention never crosses a sample boundary. The cursor
    then deals packed rows: ``batch`` sizes and ``steps`` count rows, as TRL counts packed sequences."""
    eval_files: list[str] = dataclasses.field(default_factory=list)
    """Held-out files for evaluation (``eval`` section), in the formats and with the settings of ``files``
    (paths resolved and ``s3://`` fetched the same way): a token store of their own, built once per run.
    Not with ``eval_fraction``. Not part of the config hash (they change no training step)."""
    eval_fraction: float | None = None
    """Hold this fraction of the training samples out for evaluation instead (0 < f < 1): sample ``i`` is
    held out when a keyed hash of ``(seed, i)`` falls below ``f``, so the split depends on neither the world
    size nor the ranks, and the training order runs over the other samples only. Not with ``eval_files``."""


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    r: int = 8
    """LoRA rank."""
    alpha: int = 16
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] | Literal["all-linear"] = dataclasses.field(default_factory=lambda: ["q_proj", "v_proj"])
    """Module names to adapt (a module whose full name equals an entry or ends with ``.`` + the entry), or
    ``all-linear``: every Linear (and 4-bit Linear) of the decoder layers, not the output layer (PEFT's rule)."""
    use_dora: bool = False
    """DoRA: each adapted weight split into a magnitude vector (trained, one value per output feature) and a
    direction LoRA adapts. Better at low ranks, about one more weight-sized temporary per adapted layer
    and step (the weight's norm is recomputed; on a 4-bit base, from the dequantized weight)."""
    use_rslora: bool = False
    """rsLoRA: scale the adapter by ``alpha / sqrt(r)`` instead of ``alpha / r`` (stable at high ranks)."""
    modules_to_save: list[str] | None = None
    """Modules trained in full beside the adapters (e.g. ``embed_tokens``, ``lm_head`` for new tokens or a new
    head): PEFT keeps a trainable copy of each, checkpointed and exported with the adapters. Their optimizer
    state is 2 float32 copies each (a 128k x 4096 embedding: 6 GB of state). Must not be a 4-bit module."""
    init_lora_weights: bool | Literal["gaussian", "orthogonal"] = True
    """How the adapters start (PEFT's choices that leave the base weights untouched): ``true`` (A
    Kaiming-uniform, B zero: the adapter starts as a no-op), ``gaussian`` (A normal with std 1/r, B zero),
    ``orthogonal`` (A and B orthogonal, not a no-op; ``r`` even; not on a 4-bit base), ``false`` (A and B
    random: for debugging). Drawn from ``seed``, the same on every rank and restart."""


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
    every_steps: int | Literal["auto"] | None = 10
    """Commit a checkpoint every N steps (1 to 1000000000; null: never by steps), or ``auto``: an interval
    chosen as the run goes by Young/Daly's ``sqrt(2 * C * MTBF) / step time``, from the commit cost C the
    saves measure (the seconds a save blocks training), the step time, and the run's observed mean time
    between losses (attempts that ended without a clean exit, over the time the run has trained; before any,
    ``auto_mtbf_s``). Chosen at every (re)start from the run's history in its store and again when the figures
    move it by a fifth (and a whole step) or more; each change is one ``checkpoint_interval`` event (old, new,
    reason). Not with ``keep_best``."""
    auto_mtbf_s: float = 3600.0
    """``every_steps: auto`` only: the run's mean time between losses assumed while it has seen none (and
    has lasted less than this; 60 to 1e8 s). An hour errs toward committing often: a 32-node Spot fleet
    lost a node every 4 minutes in a real p3 trace, while a few nodes at the quiet Spot Advisor buckets go
    days; committing too often costs C per interval, too rarely half an interval of work per loss."""
    every_seconds: float | None = None
    """Commit a checkpoint when this long has passed since the last one (null: never by time)."""
    keep_last: int | None = 3
    """Committed checkpoints to keep (null: keep all)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (null: none extra)."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest eval loss (the ``eval`` section's, recorded in its manifest),
    whatever ``keep_last`` says; ``elastic-ft export --best`` exports it. Needs evaluation, at steps that are
    checkpointed (``checkpoint.every_steps`` a multiple of ``eval.every_steps``)."""
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
    keep_step_in_memory: bool = True
    """At every step end, one rank per node keeps the trainable state of that step (adapters or trained weights,
    optimizer state, step, cursor) in node-local shared memory (``/dev/shm``, else the temp dir), written in the
    background; after a membership change the new world resumes from the newest step a surviving node keeps
    when it is not older than the newest commit (the holder sends it to every rank; a joining node reads no
    state from the store), and commits it right away. So a node lost between two commits costs at most the step
    in flight. Under torchrun only; ignored under ``parallelism.strategy: fsdp`` (each rank holds only its
    shards: the run resumes from the checkpoint, and the resume event says so). Costs two host copies of the
    trainable state on each node; false: every restart resumes from the newest commit."""
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
class EvalConfig:
    every_steps: int | None = None
    """Evaluate after every N optimizer steps, and after the last one (null: never). Needs held-out data:
    ``data.eval_files`` or ``data.eval_fraction``."""
    max_samples: int = 1024
    """Evaluate on the first this many held-out samples in store order (1 to 16777216): the same samples
    at every evaluation and at any world size."""


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
    quantization: QuantizationConfig = dataclasses.field(default_factory=QuantizationConfig)
    """How the frozen base is stored: 4-bit (Q-LoRA), or unquantized (the default)."""
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation on held-out data: the token-weighted loss over every rank, as ``eval`` events (see ``data``'s
    ``eval_files`` and ``eval_fraction``)."""
    inputs: InputsConfig = dataclasses.field(default_factory=InputsConfig)
    """Where each node caches the ``s3://`` data files and model directories it fetches, and their bounds."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable hash of what determines the training result (not logging or checkpoint cadence)."""
        d = self.to_dict()
        # Cadence, logging and run length may change between restarts (extend a run
        # with steps=...) without making the checkpoint a different training.
        for volatile in ("logging", "checkpoint", "spot", "inputs", "name", "steps", "epochs", "eval"):
            d.pop(volatile, None)
        d["optimizer"].pop("max_nonfinite_steps", None)  # a guard's limit, not a training setting
        d["model"].pop("gradient_checkpointing", None)  # recomputes the same activations
        d["model"].pop("loss_chunk_tokens", None)  # the same loss, summed by chunks
        if d["data"].get("messages_field") is None:  # added later: runs without chat data keep their hash
            d["data"].pop("messages_field", None)
        d["data"].pop("eval_files", None)  # held-out data changes no training step
        if d["data"].get("eval_fraction") is None:  # a split changes the training samples: hashed when set
            d["data"].pop("eval_fraction", None)
        d.pop("parallelism", None)  # where the state lives, not what is computed (up to the order of float sums)
        # Sections added later hash as before while at their defaults: older runs keep their hash.
        for section, cls in (("precision", PrecisionConfig), ("quantization", QuantizationConfig)):
            if d.get(section) == dataclasses.asdict(cls()):
                d.pop(section)
        lora, lora_defaults = d.get("lora"), dataclasses.asdict(LoraConfig())
        for added in ("use_dora", "use_rslora", "modules_to_save", "init_lora_weights"):
            if lora is not None and lora.get(added) == lora_defaults[added]:
                lora.pop(added)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
