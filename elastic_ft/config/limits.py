"""The bound of every numeric field of the job spec (checked by :func:`elastic_ft.config.bounds.out_of_range`)."""

from __future__ import annotations

from elastic_ft.checkpoint.retention import RANGES as RETENTION_RANGES
from elastic_ft.config.bounds import Bound

MAX_STEPS = 10**9
"""Steps of a run (and step counts like warm-up and cadence); manifest keys hold 12 digits."""
MAX_BATCH = 2**24
"""Samples in one step; the trainer also refuses more than the dataset holds."""
_MiB, _GiB, _TiB = 2**20, 2**30, 2**40


# Every numeric field of the spec, so no input can make the trainer allocate,
# loop or overflow without limit (a billion-sample batch, epochs=1e308).
# Null (where a field allows it) is always accepted. A new numeric field gets a row.
LIMITS: dict[str, Bound] = {
    "data.max_length": Bound(2, 2**17),  # 131072 tokens: the longest contexts models train on
    "data.eval_fraction": Bound(0.0, 1.0, lo_open=True, hi_open=True),
    "eval.every_steps": Bound(1, MAX_STEPS),
    "eval.max_samples": Bound(1, MAX_BATCH),
    "model.loss_chunk_tokens": Bound(1, 2**24),
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
    "checkpoint.every_steps": Bound(1, MAX_STEPS, words=("auto",)),
    "checkpoint.every_seconds": Bound(0.0, 1e8, lo_open=True),
    "checkpoint.auto_mtbf_s": Bound(60.0, 1e8),
    "checkpoint.keep_last": Bound(*RETENTION_RANGES["keep_last"]),
    "checkpoint.keep_every": Bound(*RETENTION_RANGES["keep_every"]),
    "checkpoint.orphan_grace_s": Bound(*RETENTION_RANGES["orphan_grace_s"]),
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
    "parallelism.shard_size": Bound(1, 2**16),
    "spot.poll_interval_s": Bound(0.1, 60.0),
    "spot.imds_timeout_s": Bound(0.05, 30.0),
    "spot.token_ttl_s": Bound(1, 21600),
    "spot.sigterm_grace_s": Bound(1.0, 3600.0),
    "spot.sigterm_boundary_s": Bound(1.0, 3600.0),
    "spot.margin_s": Bound(0.0, 3600.0),
    "spot.collective_timeout_s": Bound(10.0, 86400.0),
    "inputs.max_file_bytes": Bound(1, 5 * _TiB),  # S3's largest object
    "inputs.max_model_bytes": Bound(1, 16 * _TiB),
    "inputs.max_model_files": Bound(1, 10**6),
    "inputs.lock_timeout_s": Bound(1.0, 86400.0),
}
