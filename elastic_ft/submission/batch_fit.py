"""Whether the largest world a submission can reach fits the job spec's batch.

Under ``batch.policy: constant_global`` every rank takes at least one sample
of the ``global_batch`` per step, so a job whose max nodes times processes per
node exceeds it cannot run at that size; refused here, at submission, naming
both sides, rather than met by the nodes once the last of them joins.

The spec is read as config validation reads it (the bounded YAML, the
overrides, every field's type, range and cross-field rules) but without the
data files' existence check: on a remote scheduler they are paths inside the
image. A spec that cannot be read or validated here is left to the worker,
which reports it on the node with the same messages (and on aws_batch the
file may exist only in the image). One small file, read once per submission.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from elastic_ft.submission.arguments import shown

if TYPE_CHECKING:
    from elastic_ft.config import BatchConfig


def spec_batch(spec: str, overrides: Sequence[str]) -> Optional[BatchConfig]:
    """The ``batch`` section of spec file ``spec`` with ``overrides`` applied, or None if it does not validate."""
    # Imported here: torchx imports this module for every command that lists or runs components,
    # and the spec's modules (about 0.4 s) are only needed when elastic_ft.train is run.
    from elastic_ft.config import ConfigError, spec_from_dict
    from elastic_ft.config.spec_yaml import YamlInputError, read_yaml_file

    try:
        raw = read_yaml_file(spec) or {}
    except YamlInputError:
        return None
    if not isinstance(raw, dict):
        return None
    try:
        return spec_from_dict(raw, overrides=tuple(overrides), source=spec, check_files=False).batch
    except ConfigError:
        return None


def world_problem(batch: BatchConfig, *, spec: str, max_nodes: int, nnodes: str, nproc_per_node: int) -> Optional[str]:
    """Why ``max_nodes`` nodes of ``nproc_per_node`` processes cannot run ``batch``, in one line, or None."""
    world = max_nodes * nproc_per_node
    if batch.policy != "constant_global" or world <= batch.global_batch:
        return None
    nodes_fit = batch.global_batch // nproc_per_node
    smaller = (f"give --nnodes with a max of at most {nodes_fit}" if nodes_fit else
               f"give --nproc_per_node at most {batch.global_batch}")
    return (
        f"--nnodes {nnodes} x --nproc_per_node {nproc_per_node} = {world} processes at most, more than "
        f"batch.global_batch {batch.global_batch} of {shown(spec)} under batch.policy constant_global (every "
        f"process takes at least one sample per step): {smaller}, or raise batch.global_batch to at least "
        f"{world} (override batch.global_batch={world})"
    )


def check_batch_fits(spec: str, overrides: Sequence[str], *, max_nodes: int, nnodes: str, nproc_per_node: int) -> None:
    """Raise ValueError with :func:`world_problem`'s line when the spec is readable here and the world does not fit."""
    batch = spec_batch(spec, overrides)
    if batch is not None:
        problem = world_problem(batch, spec=spec, max_nodes=max_nodes, nnodes=nnodes, nproc_per_node=nproc_per_node)
        if problem:
            raise ValueError(problem)
