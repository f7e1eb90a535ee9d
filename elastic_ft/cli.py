"""``elastic-ft``: train in this process, inspect and verify checkpoints, export.

  elastic-ft train [--spec S] [--run_id R] [--checkpoint_uri U] [k=v ...]
  elastic-ft ckpt ls URI            committed checkpoints of a run (step, time, size)
  elastic-ft ckpt verify URI        re-hash the newest checkpoint (exit 1 naming a bad blob)
  elastic-ft ckpt gc URI [--dry-run] retention and orphan collection
  elastic-ft export URI --out DIR [--step N | --best] [--merge]
  elastic-ft doctor [--rdzv_endpoint H:P] [--run_id R] [--checkpoint_uri U] [--post]  check a node for multi-node failures
  elastic-ft goodput RUN            where a run's wall time went (RUN: the run's URI, whose store's events/ are
                                    read, or events.jsonl, its directory, the run's directory or its id)
  elastic-ft events URI [--event NAME ...]   the run's events from its store, merged and ordered (JSON lines)
  elastic-ft status URI [--rdzv_endpoint H:P] the run at a glance: steps, checkpoint, world, interruptions,
                                    goodput, tokens/s, ETA
  elastic-ft plot RUN --out run.png loss and LR by step, tokens/s and world over time, with checkpoints,
                                    preemptions and rescales marked (the plot extra: matplotlib; RUN as for goodput)

URI is a run's location, e.g. file:///abs/runs/RUN_ID or s3://bucket/prefix/RUN_ID.

Only what a command needs is imported when it runs (torch for train and
export), so ``--help`` and the read-only commands (``ckpt``, ``status``, ``events``,
``goodput``) answer quickly: tests/unit/test_cli_no_torch.py holds them to it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from elastic_ft import __version__
from elastic_ft.doctor.command import add_parser as add_doctor  # argparse only: the checks import lazily
from elastic_ft.runevents.commands import add_parsers as add_run_event_commands  # argparse only, too
from elastic_ft.viz.figure import MissingExtra  # matplotlib itself is imported when a figure is drawn
from elastic_ft.worker import USER_ERRORS, add_run_arguments, run_from_args


def _ls(args) -> int:
    from elastic_ft.checkpoint.manifest import ManifestError, ManifestForeign, step_of_key
    from elastic_ft.checkpoint.reader import list_manifests, read_manifest
    from elastic_ft.checkpoint.store import open_store

    store = open_store(args.uri)
    infos = list_manifests(store)
    if not infos:  # a typo'd URI must not read as an empty but healthy run
        print(f"elastic-ft: no committed checkpoints at {args.uri} (a run's location is <checkpoint_uri>/<run_id>)",
              file=sys.stderr)
        return 1
    print(f"{'step':>8}  {'committed (UTC)':<20} {'size':>12}  {'world':>5}  manifest")
    for info in infos:
        try:
            m = read_manifest(store, info.key, size=info.size)
        except ManifestError as exc:  # one broken manifest is a row of the listing, not the end of it
            kind = "FOREIGN" if isinstance(exc, ManifestForeign) else "CORRUPT"
            print(f"{step_of_key(info.key):>8}  {kind}: {exc}")
            continue
        when = datetime.datetime.fromtimestamp(m.created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{m.step:>8}  {when:<20} {m.total_size:>12,}  {m.world.get('size', '?'):>5}  {info.key}")
    return 0


def _verify(args) -> int:
    """Exit 0: verified; 1: proven corrupt (named); 2: nothing concluded, because it could not be read
    (from :func:`main`) or there is no such checkpoint (a run that does not exist is not a corrupt one)."""
    from elastic_ft.checkpoint.manifest import ManifestCorrupt, manifest_key, step_of_key
    from elastic_ft.checkpoint.reader import list_manifests, read_manifest, verify
    from elastic_ft.checkpoint.store import open_store

    store = open_store(args.uri)
    infos = list_manifests(store)
    if not infos:
        print(f"elastic-ft: error: no committed checkpoints at {args.uri} to verify (a run's location is "
              f"<checkpoint_uri>/<run_id>)", file=sys.stderr)
        return 2
    if args.step is not None:
        key = manifest_key(args.step)
        if key not in {info.key for info in infos}:
            problem = missing_step_problem(args.step, [step_of_key(info.key) for info in infos])
            print(f"elastic-ft: error: ckpt verify --step {args.step}: {args.uri} {problem}", file=sys.stderr)
            return 2
    else:
        key = infos[-1].key
    try:
        manifest = read_manifest(store, key)
    except ManifestCorrupt as exc:
        print(f"checkpoint {store.join(key)} FAILED verification: {exc}", file=sys.stderr)
        return 1
    problems = verify(store, manifest)
    if problems:
        print(f"checkpoint at step {manifest.step} FAILED verification ({store.join(key)}):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"checkpoint at step {manifest.step} OK: {len(manifest.blobs)} blobs, {manifest.total_size:,} bytes verified")
    return 0


def _gc(args) -> int:
    from elastic_ft.checkpoint.manifest import BLOB_PREFIX
    from elastic_ft.checkpoint.reader import list_manifests
    from elastic_ft.checkpoint.retention import RetentionPolicy, apply_gc, collect
    from elastic_ft.checkpoint.store import open_store

    store = open_store(args.uri)
    # A typo'd URI must not read as a run with nothing to collect (the blobs are listed only without manifests).
    if not list_manifests(store) and not store.list(BLOB_PREFIX):
        print(f"elastic-ft: no checkpoints or blobs at {args.uri}, nothing to collect (a run's location is "
              f"<checkpoint_uri>/<run_id>)", file=sys.stderr)
        return 1
    policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every, orphan_grace_s=args.grace,
                             keep_best=args.keep_best)
    plan = collect(store, policy, time.time())
    for line in plan.lines():
        print(("would " if args.dry_run and line.startswith("delete") else "") + line)
    if not args.dry_run:
        apply_gc(store, plan)
        print(f"deleted {len(plan.manifests)} manifest(s) and {len(plan.blobs)} blob(s)")
    return 0


def _goodput(args) -> int:
    from elastic_ft.runevents.goodput import attribute

    source, events = _run_events(args.run, "goodput")
    print(f"{source}\n{attribute(events).table()}")
    return 0


def _run_events(run: str, command: str) -> tuple[str, list[dict]]:
    """Where RUN's events are and the events (a URI's store ``events/``, else a local file); ArgumentError naming
    ``command``. Every attempt's events, steps redone after a restart included: goodput counts them."""
    from elastic_ft.runevents.load import load_run_events

    try:
        source, events = load_run_events(run)
    except FileNotFoundError as exc:
        raise ArgumentError(f"{command}: {exc}") from None
    note = events.note(source)
    if note:
        print(f"elastic-ft: {note}", file=sys.stderr)
    if not any(e.get("event") == "start" for e in events):
        raise ArgumentError(f"{command}: {source} has no start event: not a training run's events")
    return source, events


def _plot(args) -> int:
    from elastic_ft.viz.figure import render
    from elastic_ft.viz.series import run_series

    problem = out_file_problem(args.out)
    if problem:
        raise ArgumentError(f"plot --out {problem}")
    path, events = _run_events(args.run, "plot")
    series = run_series(events)
    render(series, args.out, width=args.width, height=args.height)
    kinds = [m.kind for m in series.marks]
    marked = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) or "nothing marked"
    print(f"wrote {args.out} ({args.width}x{args.height}): {len(series.step)} steps, {series.attempts} attempt(s), "
          f"{marked}; from {path}")
    return 0


def out_file_problem(out: str) -> str | None:
    """Why ``out`` cannot be written as a file (a directory, or its directory missing), or None."""
    if os.path.isdir(out):
        return f"{out!r} is a directory; name the PNG file to write, e.g. {os.path.join(out, 'run.png')!r}"
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        return f"{out!r} cannot be written: its directory {parent!r} does not exist"
    return None


def _pixels(text: str) -> int:
    """An argparse type: a figure side in pixels."""
    from elastic_ft.config.bounds import Bound, parse_number

    try:
        return int(parse_number(text, int, Bound(200, 10000)))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class ArgumentError(ValueError):
    """A command-line argument that cannot work, found before anything is loaded; the message names it."""


def out_dir_problem(out: str, *, force: bool = False) -> str | None:
    """Why ``out`` cannot be the export directory (an existing file, or under one, or a directory
    that holds anything while ``force`` is off), or None.

    An empty directory is fine. A non-empty one would get export's files among
    its own (and lose those with the same names, an earlier export's weights
    among them): refused, naming what is there, unless ``force``.
    """
    if os.path.isdir(out):
        if force:
            return None
        try:
            names = sorted(os.listdir(out))
        except OSError as exc:
            return f"{out!r} cannot be read: {exc.strerror or exc}"
        if not names:
            return None
        shown = ", ".join(n + ("/" if os.path.isdir(os.path.join(out, n)) else "") for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return (f"{out!r} is not empty (it holds {shown}{more}); name a new or empty directory, "
                f"or add --force to write the export among those files (replacing any of the same name)")
    if os.path.lexists(out):
        return f"{out!r} is an existing file; name a directory (new or existing)"
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{out!r} cannot be created: {parent!r} is a file; name a directory"
    return None


def missing_step_problem(step: int, steps: list[int], *, shown: int = 10) -> str | None:
    """Why ``--step`` cannot be exported (no committed checkpoint there), naming the steps there are; or None."""
    if step in steps:
        return None
    if not steps:
        return f"has no committed checkpoint at step {step}, nor at any other step"
    listed = ", ".join(map(str, steps[-shown:]))
    more = f" (the newest {shown} of {len(steps)})" if len(steps) > shown else ""
    return f"has no committed checkpoint at step {step}; its committed steps{more}: {listed}"


def best_checkpoint(uri: str) -> int:
    """The step of the run's committed checkpoint with the lowest eval loss; ArgumentError when none has one."""
    from elastic_ft.checkpoint.manifest import ManifestError
    from elastic_ft.checkpoint.reader import list_manifests, read_manifest
    from elastic_ft.checkpoint.retention import best_step, eval_losses
    from elastic_ft.checkpoint.store import open_store

    store = open_store(uri)
    read = []
    try:
        infos = list_manifests(store)
        for info in infos:
            try:
                read.append(read_manifest(store, info.key, size=info.size))
            except ManifestError:  # a broken one is no candidate; the others still are
                continue
    finally:
        store.close()
    losses = eval_losses(read)  # by the step evaluated: a late record names an earlier checkpoint
    best = best_step({m.step: losses.get(m.step) for m in read})
    if best is None:
        what = (f"none of its {len(infos)} committed checkpoint(s) records an eval loss (evaluated runs record "
                f"one at each checkpoint of an evaluated step: eval.every_steps)") if infos else \
            "has no committed checkpoint"
        raise ArgumentError(f"export --best: {uri} {what}; export --step N or the newest instead")
    return best


def _check_export_args(args) -> None:
    """Refuse a bad ``--out``, ``--step`` or ``--best`` before export loads any checkpoint or model."""
    problem = out_dir_problem(args.out, force=args.force)
    if problem:
        raise ArgumentError(f"export --out {problem}")
    if args.best:
        args.step = best_checkpoint(args.uri)
        return
    if args.step is None:
        return
    from elastic_ft.checkpoint.manifest import step_of_key
    from elastic_ft.checkpoint.reader import list_manifests
    from elastic_ft.checkpoint.store import open_store

    store = open_store(args.uri)
    try:
        steps = [step_of_key(info.key) for info in list_manifests(store)]
    finally:
        store.close()
    problem = missing_step_problem(args.step, steps)
    if problem:
        raise ArgumentError(f"export --step {args.step}: {args.uri} {problem}")


def _export(args) -> int:
    from elastic_ft.train.quiet import quiet_libraries

    quiet_libraries()  # before transformers is imported: its progress bars read the environment then
    from elastic_ft.train.export import export

    _check_export_args(args)
    result = export(args.uri, args.out, step=args.step, merge=args.merge)
    kind = "PEFT adapter" if result["lora"] else "model"
    best = " (the lowest eval loss)" if args.best else ""
    if "merged_dtype" in result:
        kind = f"model with the adapters merged, in {result['merged_dtype']},"
    print(f"exported step {result['step']}{best} as a {kind} to {result['out']}")
    return 0


def _in_range(field: str, kind: type):
    """An argparse type: ``kind`` within the spec's range for ``field`` (config.LIMITS).

    argparse prints the message after the flag's name: ``argument --keep-last: must be in [1, 1000000], got '-5'``.
    """
    from elastic_ft.config.bounds import parse_number
    from elastic_ft.config import LIMITS

    def parse(text: str):
        try:
            return parse_number(text, kind, LIMITS[field])
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-ft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run the job in this process (torchrun runs one per rank)")
    add_run_arguments(t)
    t.set_defaults(func=run_from_args)
    ck = sub.add_parser("ckpt", help="inspect a run's checkpoints").add_subparsers(dest="ckpt", required=True)
    uri_help = "the run's location: file:///abs/runs/RUN_ID, file://./runs/RUN_ID or s3://bucket/prefix/RUN_ID"
    ls = ck.add_parser("ls", help="list committed checkpoints (exit 1 if there are none)")
    ls.add_argument("uri", help=uri_help)
    ls.set_defaults(func=_ls)
    v = ck.add_parser("verify", help="re-hash every blob of the newest (or --step) checkpoint")
    v.add_argument("uri", help=uri_help)
    v.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    v.set_defaults(func=_verify)
    g = ck.add_parser("gc", help="delete checkpoints past retention and orphan blobs")
    g.add_argument("uri", help=uri_help)
    g.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    # The same ranges as the spec's checkpoint section: --keep-last -5 used to delete all but the newest.
    g.add_argument("--keep-last", type=_in_range("checkpoint.keep_last", int), default=3,
                   help="newest committed checkpoints to keep (at least 1)")
    g.add_argument("--keep-every", type=_in_range("checkpoint.keep_every", int), default=None,
                   help="also keep checkpoints whose step is a multiple of this")
    g.add_argument("--grace", type=_in_range("checkpoint.orphan_grace_s", float), default=3600.0,
                   help="seconds before an orphan blob may be deleted (a save in flight has young orphans)")
    g.add_argument("--keep-best", action="store_true",
                   help="also keep the checkpoint with the lowest eval loss its manifest records")
    g.set_defaults(func=_gc)
    e = sub.add_parser("export", help="write a PEFT adapter (or full model) directory")
    e.add_argument("uri", help=uri_help)
    e.add_argument("--out", required=True, help="directory to write (created if missing; an existing one must "
                                                "be empty unless --force)")
    e.add_argument("--force", action="store_true",
                   help="write into --out even if it holds files (those of the same name are replaced)")
    which = e.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    which.add_argument("--best", action="store_true",
                       help="the checkpoint with the lowest eval loss (recorded in its manifest; see eval.every_steps)")
    e.add_argument("--merge", action="store_true",
                   help="LoRA runs: write the adapters merged into the base, a plain model directory (in the base's "
                        "dtype; a 4-bit base dequantized to quantization.compute_dtype)")
    e.set_defaults(func=_export)
    gp = sub.add_parser("goodput", help="a run's wall time by category: kept and redone steps, checkpoint, restart, loading")
    gp.add_argument("run", help="the run's URI (file:// or s3://, as for ckpt ls: its store's events/, else the local "
                                "events.jsonl), events.jsonl, the directory holding it (logging.dir), the run directory "
                                "or its id")
    gp.set_defaults(func=_goodput)
    add_run_event_commands(sub)
    pl = sub.add_parser("plot", help="a PNG of the run: loss and LR by step, tokens/s and world over time, with "
                                     "checkpoints, preemptions and rescales marked")
    pl.add_argument("run", help="as for goodput: the run's URI (its store's events/), events.jsonl, its directory, "
                                "the run directory or its id")
    pl.add_argument("--out", required=True, help="the PNG file to write (its directory must exist)")
    pl.add_argument("--width", type=_pixels, default=1200, help="width in pixels (default 1200)")
    pl.add_argument("--height", type=_pixels, default=800, help="height in pixels (default 800)")
    pl.set_defaults(func=_plot)
    add_doctor(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS + (ArgumentError, MissingExtra) as exc:
        print(f"elastic-ft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
