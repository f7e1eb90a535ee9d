"""Reading a run's events: from its checkpoint store's ``events/`` where they are there, else the local file."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping

from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.runevents.layout import PREFIX, parse_batch_key
from elastic_ft.runevents.merge import merge
from elastic_ft.runevents.schema import EventList


def read_store_events(store: ObjectStore) -> EventList:
    """Every well-formed event shipped to ``store`` (a run's location), merged
    (:func:`~elastic_ft.runevents.merge.merge`; the malformed ones counted in ``skipped``); [] when none was. Steps trained again are all there: see :func:`~elastic_ft.runevents.merge.latest_steps`."""
    keys = [o.key for o in store.list(PREFIX) if parse_batch_key(o.key) is not None]
    # One object per checkpoint interval: a long run has thousands, small; fetched side by side.
    with concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="events-read") as pool:
        texts = list(pool.map(lambda k: bytes(store.get(k)).decode("utf-8", "replace"), keys))
    return merge(zip(keys, texts))


def store_events(uri: str) -> EventList:
    """:func:`read_store_events` of the run at ``uri`` (``file://...``, ``s3://...``), opening and closing its store."""
    from elastic_ft.checkpoint.store import open_store

    store = open_store(uri.rstrip("/"))
    try:
        return read_store_events(store)
    finally:
        store.close()


def load_run_events(run: str, environ: Mapping[str, str] | None = None) -> tuple[str, EventList]:
    """``(where they came from, events)`` of a run, every attempt's, in order.

    ``run`` is a run's location (``file:///abs/runs/RUN_ID``, ``s3://bucket/prefix/RUN_ID``), whose
    store's ``events/`` is read when it holds any; otherwise (or for a path or a run id) the local
    ``events.jsonl`` that :func:`~elastic_ft.runevents.goodput.find_events` finds. Steps trained again after a
    restart appear once per attempt that trained them (goodput counts the redone ones); apply
    :func:`~elastic_ft.runevents.merge.latest_steps` for one event per step. Malformed events are skipped
    and counted (:class:`~elastic_ft.runevents.schema.EventList`). Raises FileNotFoundError
    naming where it looked, and the store's errors when it cannot be read.
    """
    from elastic_ft.runevents.events import read_events
    from elastic_ft.runevents.goodput import find_events

    if "://" in run:
        events = store_events(run)
        if events:
            return f"{run.rstrip('/')}/{PREFIX}", events
    try:
        path = find_events(run, environ)
    except FileNotFoundError as exc:
        where = f"no events in {run.rstrip('/')}/{PREFIX} and " if "://" in run else ""
        raise FileNotFoundError(f"{where}{exc}") from None
    return path, read_events(path)
