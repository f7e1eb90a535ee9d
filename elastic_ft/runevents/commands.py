"""``elastic-ft events`` and ``elastic-ft status``: a run's durable events, and the run at a glance.

Both take a run's location, as ``ckpt ls`` does (``file:///abs/runs/RUN_ID``,
``s3://bucket/prefix/RUN_ID``), and read what its leaders shipped there
(:mod:`elastic_ft.runevents`), so they work from any machine, whichever nodes
are gone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

_URI_HELP = "the run's location: file:///abs/runs/RUN_ID, file://./runs/RUN_ID or s3://bucket/prefix/RUN_ID"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("events", help="a run's events from its checkpoint store, merged and ordered (JSON lines)")
    e.add_argument("uri", help=_URI_HELP)
    e.add_argument("--event", action="append", default=None, metavar="NAME",
                   help="only events of this name (step, start, checkpoint_committed, ...); repeat for several")
    e.add_argument("--all", action="store_true",
                   help="also the events of steps a later attempt trained again (default: the latest of each step)")
    e.set_defaults(func=events_command)
    s = sub.add_parser("status", help="a run at a glance: progress, checkpoint, world, interruptions, goodput, ETA")
    s.add_argument("uri", help=_URI_HELP)
    s.add_argument("--rdzv_endpoint", "--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="the run's etcd: read the current world from its rendezvous (default: from the last events)")
    s.add_argument("--rdzv_conf", "--rdzv-conf", default=None, metavar="K=V,...",
                   help="the rendezvous options the job gave torchrun (key_prefix, TLS, credentials)")
    s.set_defaults(func=status_command)


def events_command(args: argparse.Namespace) -> int:
    from elastic_ft.runevents.load import store_events
    from elastic_ft.runevents.merge import latest_steps

    events = store_events(args.uri)
    _report_skipped(events, f"{args.uri.rstrip('/')}/events/")
    if not events:
        print(f"elastic-ft: no events at {args.uri.rstrip('/')}/events/ (a run's location is "
              f"<checkpoint_uri>/<run_id>; runs before this version kept them only in their events.jsonl)",
              file=sys.stderr)
        return 1
    if not args.all:
        events = latest_steps(events)
    names = set(args.event or ())
    out = sys.stdout
    for e in events:
        if not names or e.get("event") in names:
            out.write(json.dumps(e, default=str) + "\n")
    return 0


def _report_skipped(events, source: str) -> None:
    """One line on stderr for the malformed events a reader skipped (an
    :class:`~elastic_ft.runevents.schema.EventList`'s count), once per command."""
    note = events.note(source)
    if note:
        print(f"elastic-ft: {note}", file=sys.stderr)


def _checkpoints(uri: str) -> tuple:
    """(the newest committed checkpoint or None, how many are committed)."""
    from elastic_ft.checkpoint.manifest import ManifestError, step_of_key
    from elastic_ft.checkpoint.reader import list_manifests, read_manifest
    from elastic_ft.checkpoint.store import open_store
    from elastic_ft.runevents.status import Checkpoint

    store = open_store(uri)
    try:
        infos = list_manifests(store)
        if not infos:
            return None, 0
        try:
            m = read_manifest(store, infos[-1].key, size=infos[-1].size)
            return Checkpoint(step=m.step, created=m.created), len(infos)
        except ManifestError:  # still a commit; its listing's time stands in for its own
            return Checkpoint(step=step_of_key(infos[-1].key) or -1, created=infos[-1].mtime), len(infos)
    finally:
        store.close()


def status_command(args: argparse.Namespace) -> int:
    from elastic_ft.runevents.load import store_events
    from elastic_ft.runevents.status import summary

    uri = args.uri.rstrip("/")
    events = store_events(uri)
    _report_skipped(events, f"{uri}/events/")
    newest, count = _checkpoints(uri)
    if not events and newest is None:
        print(f"elastic-ft: no events and no committed checkpoints at {uri} (a run's location is "
              f"<checkpoint_uri>/<run_id>)", file=sys.stderr)
        return 1
    live, note = None, None
    if args.rdzv_endpoint:
        from elastic_ft.runevents.live import live_world

        try:
            live = live_world(args.rdzv_endpoint, args.rdzv_conf, uri.rpartition("/")[2])
        except Exception as exc:  # the rest of the status stands without it
            note = f"rendezvous: could not read {args.rdzv_endpoint}: {str(exc).splitlines()[0] if str(exc) else exc}"
    lines = summary(uri, events, newest, now=time.time(), live=live, asked_rendezvous=bool(args.rdzv_endpoint),
                    committed=count)
    print("\n".join(lines + ([note] if note else [])))
    return 0
