"""The process torchrun starts on every rank: ``python -m elastic_ft.worker``.

Parse, build, run, close. Errors a user can fix (spec, URI, data, foreign
checkpoint) end the process with one clear line and exit code 2; a run that
committed its state and left on a spot notice exits with
:data:`~elastic_ft.train.preemption.PREEMPTED_EXIT_CODE` (75), on every rank:
on the node that leaves, after writing the leave marker that makes its etcd3
agent leave the rendezvous and exit 75 as well (:mod:`elastic_ft.handoff.leave_marker`);
elsewhere torchrun restarts the workers in the smaller world.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from elastic_ft.checkpoint.manifest import ManifestError
from elastic_ft.checkpoint.store import StoreError, check_uri
from elastic_ft.config import ConfigError, load_spec
from elastic_ft.runevents.events import events_dir
from elastic_ft.config.names import name_problem
from elastic_ft.train.quiet import quiet_libraries
from elastic_ft.spot.imds import EndpointError
from elastic_ft.train.datafiles import DataError  # not train.data: it imports torch, and --help must not
from elastic_ft.train.peer_loss import collective_failure
from elastic_ft.train.scaling import BatchPlanError

USER_ERRORS = (ConfigError, StoreError, DataError, BatchPlanError, ManifestError, EndpointError)


def _run_id(text: str) -> str:
    # The run id is a path component of every checkpoint key: '../x' would write
    # outside --checkpoint_uri. argparse prefixes the message with the flag.
    problem = name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default="specs/tiny-lora.yaml", help="job spec YAML")
    p.add_argument("--run_id", "--run-id", default=None, type=_run_id,
                   help="stable id of the job across restarts (default: the spec's name); "
                        "letters, digits, '.', '_', '-', at most 128 characters")
    p.add_argument("--checkpoint_uri", "--checkpoint-uri", default="file://./runs",
                   help="where run directories live: file:///abs/dir, file://./rel/dir or s3://bucket/prefix")
    p.add_argument("--log_dir", "--log-dir", default=None, help="events.jsonl directory (default: the spec's logging.dir, else the run's directory's logs/ for a "
                        "file:// checkpoint URI, ~/.cache/elastic_ft/runs/RUN_ID/logs for s3://)")
    p.add_argument("overrides", nargs="*", help="spec overrides, e.g. optimizer.lr=3e-4 steps=200")


def run_from_args(args: argparse.Namespace, *, own_process: bool = False) -> int:
    """Run the job ``args`` name in this process; the exit code. ``own_process``: the process is the
    worker's alone (``python -m elastic_ft.worker``, as torchrun starts it), so process-wide choices for
    its start are made (bitsandbytes kept out unless the base is 4-bit); a caller that runs it in-process
    (``elastic-ft train``, tests) keeps its interpreter as it is."""
    from elastic_ft.train.loop import RunAborted, RunOptions, run
    from elastic_ft.train.preemption import PREEMPTED_EXIT_CODE, Preempted
    from elastic_ft.train.quantization import keep_bitsandbytes_out

    logging.basicConfig(
        level=os.environ.get("ELASTIC_FT_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s [rank " + os.environ.get("RANK", "0") + "] %(name)s: %(message)s",
    )
    quiet_libraries()  # their chatter (peft/transformers warnings, progress bars) would drown the progress lines
    try:
        check_uri(args.checkpoint_uri)  # as typed, before any work: joined with the run id it reads garbled
        spec = load_spec(args.spec, args.overrides)
        if own_process:
            keep_bitsandbytes_out(spec.quantization)  # before peft is imported (the model's build)
        run_id = args.run_id or spec.name
        log_dir = args.log_dir or events_dir(args.checkpoint_uri, run_id, template=spec.logging.dir)
        run(spec, RunOptions(run_id=run_id, checkpoint_uri=args.checkpoint_uri, log_dir=log_dir))
    except USER_ERRORS + (RunAborted,) as exc:
        print(f"elastic_ft: error: {exc}", file=sys.stderr)
        return 2
    except Preempted as exc:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank of the node leaves alike: one line per node
            print(f"elastic_ft: {exc}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except Exception as exc:
        lost = collective_failure(exc)
        if lost is None:
            raise  # a bug's traceback must show
        # A peer is gone: the agent restarts the workers (its own line says which node and why).
        # Every rank of the node meets it: one line per node, from its local rank 0.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"elastic_ft: a collective failed, a peer is gone: {lost}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    p = argparse.ArgumentParser(prog="python -m elastic_ft.worker", description=__doc__)
    add_run_arguments(p)
    return run_from_args(p.parse_args(argv), own_process=own_process)


def finish(code: int) -> None:
    """End the process with ``code``, without the interpreter's finalization (see
    :func:`~elastic_ft.train.world.exit_process`: it races gloo's threads, and waits for a timed-out barrier)."""
    from elastic_ft.train.world import exit_process

    exit_process(code)


def warm_preload(variant: str) -> None:
    """What the node's warm process (:mod:`elastic_ft.warm`) imports before it forks workers: every library a
    worker's start imports, and the model classes of the architectures fine-tuned most, so a forked worker
    starts with them in place. ``variant``: ``4bit`` keeps bitsandbytes importable (a Q-LoRA run needs it),
    ``plain`` keeps it out, as a cold worker of such a run does (:func:`keep_bitsandbytes_out`)."""
    import importlib

    from elastic_ft.config import QuantizationConfig
    from elastic_ft.train.quantization import keep_bitsandbytes_out

    if variant != "4bit":
        keep_bitsandbytes_out(QuantizationConfig())
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library, or an architecture this transformers lacks: imported at need
            pass


_PRELOAD = (
    "elastic_ft.train.loop", "elastic_ft.train.build", "elastic_ft.train.model", "elastic_ft.train.heldout",
    "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
    "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_fast",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral", "transformers.models.gpt2.modeling_gpt2",
    "peft", "peft.tuners.lora", "tokenizers", "safetensors.torch", "boto3", "botocore.session",
)


def _warm_variant(argv: list[str]) -> str:
    """Which preload this command needs: ``4bit`` when its spec quantizes the base. A spec that does not
    load is the worker's to report (in the fork, as a cold start would)."""
    p = argparse.ArgumentParser(add_help=False)
    add_run_arguments(p)
    try:
        args, _ = p.parse_known_args(argv)
        return "4bit" if load_spec(args.spec, args.overrides).quantization.load_in_4bit else "plain"
    except (Exception, SystemExit):  # noqa: BLE001 - whatever it is, the worker itself says it
        return "plain"


if __name__ == "__main__":
    from elastic_ft.handoff import launch

    if not launch.forked_warm():  # in the fork this module runs again as __main__: run the job there
        from elastic_ft.warm import client

        client.run("elastic_ft.worker", f"elastic_ft.worker:warm_preload:{_warm_variant(sys.argv[1:])}")
    finish(main(own_process=True))
