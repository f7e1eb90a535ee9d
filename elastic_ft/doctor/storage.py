"""The checkpoint store as the job will use it: writable, refusing a second conditional create; the clock.

A checkpoint exists only if its manifest does, and the manifest is created
with ``If-None-Match: *`` so that two writers (a node that came back while its
replacement runs) cannot overwrite each other's. An S3-compatible server that
ignores the header accepts both writes silently: nothing fails, and a
checkpoint can be replaced under a reader. So the probe writes a scratch
object under the run (``<run>/.doctor/<uuid>``), creates it again
conditionally, expects a refusal, and always deletes it.

The S3 server's ``Date`` header on the way gives this node's clock skew: S3
refuses request signatures beyond 15 minutes of skew, and well before that
the rendezvous suffers, as torch's dynamic rendezvous judges a peer's
keep-alive by the wall-clock time that peer wrote (6 s with our defaults).
"""

from __future__ import annotations

import dataclasses
import email.utils
import time
import uuid
from typing import Callable

from elastic_ft.preflight.report import Result

CLOCK_BOUND_S = 5.0
# Short retries: the doctor reports a slow or failing store, it does not ride it out.
_FAST_S3 = {"max_attempts": 2, "backoff_initial": 0.1, "backoff_max": 0.5, "connect_timeout": 3.0, "read_timeout": 10.0}
_KNOWN_GOOD = "AWS S3, SeaweedFS and moto honour it (this project tests against them), as does MinIO"


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the scratch-object round trip found (all strings, for a pure decision)."""

    uri: str
    write_error: str | None = None
    """Why the first conditional create failed, if it did."""
    second: str = ""
    """``refused`` (the second create raised ObjectExists), ``accepted``, or the error it raised."""
    server_date: str | None = None
    """The S3 server's ``Date`` header (None for file stores)."""
    local_time: float = 0.0
    """This node's clock when that answer came (epoch seconds)."""
    cleanup_error: str | None = None


def store_result(p: Probe) -> Result:
    name = "checkpoint_store"
    if p.write_error is not None:
        return Result("FAIL", name, f"cannot write under {p.uri}: {p.write_error}",
                      "check the URI, the bucket's existence, and this node's credentials (write and delete rights)")
    if p.second == "accepted":
        return Result("FAIL", name, f"{p.uri} accepted a second create of the same object with If-None-Match: * "
                      "(the server ignores conditional writes): one writer's checkpoint manifest can overwrite "
                      "another's", f"use a store that honours If-None-Match: * ({_KNOWN_GOOD})")
    if p.second != "refused":
        return Result("FAIL", name, f"{p.uri} failed a second conditional create instead of refusing it with "
                      f"412: {p.second}", f"use a store that supports If-None-Match: * on PUT ({_KNOWN_GOOD})")
    left = f"; the scratch object could not be deleted ({p.cleanup_error})" if p.cleanup_error else ""
    return Result("WARN" if left else "PASS", name,
                  f"{p.uri} is writable and refuses a second conditional create{left}",
                  "delete <uri>/<run_id>/.doctor/ by hand and check delete rights" if left else "")


def clock_result(server_date: str | None, local_time: float, bound_s: float = CLOCK_BOUND_S) -> Result:
    """This node's clock against the server's ``Date`` (1 s resolution), within ``bound_s``."""
    name = "clock"
    if server_date is None:
        return Result("SKIP", name, "no S3 server answered (the check needs an s3:// --checkpoint_uri)")
    try:
        server = email.utils.parsedate_to_datetime(server_date).timestamp()
    except (TypeError, ValueError):
        return Result("WARN", name, f"the S3 server's Date header {server_date!r} is unreadable", "")
    skew = local_time - server
    found = f"this node's clock is {abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} the S3 server's"
    if abs(skew) <= bound_s + 1:  # + 1: Date has whole seconds
        return Result("PASS", name, f"{found} (bound {bound_s:g} s)")
    return Result("FAIL", name, f"{found}, over {bound_s:g} s: peers judge keep-alives by wall-clock stamps, and S3 "
                  "refuses signatures beyond 15 min of skew", "run chrony/ntpd (on EC2: the Amazon Time Sync Service)")


def probe_store(uri: str, clock: Callable[[], float] = time.time) -> Probe:
    """Write, conditionally re-create and delete ``<uri>/.doctor/<uuid>``; never raises for store faults."""
    from elastic_ft.checkpoint.errors import ObjectExists, StoreError
    from elastic_ft.checkpoint.store import open_store

    key = f".doctor/{uuid.uuid4().hex}"
    try:
        store = open_store(uri, {"s3": _FAST_S3})
    except StoreError as exc:
        return Probe(uri, write_error=str(exc))
    try:
        try:
            store.put(key, b"elastic-ft doctor scratch object", if_absent=True)
        except StoreError as exc:
            return Probe(uri, write_error=str(exc))
        date, local = _server_date(store, key, clock)
        try:
            store.put(key, b"second", if_absent=True)
            second = "accepted"
        except ObjectExists:
            second = "refused"
        except StoreError as exc:
            second = str(exc)
        cleanup = None
        try:
            store.delete(key)
        except StoreError as exc:
            cleanup = str(exc)
        return Probe(uri, second=second, server_date=date, local_time=local, cleanup_error=cleanup)
    finally:
        store.close()


def _server_date(store: object, key: str, clock: Callable[[], float]) -> tuple[str | None, float]:
    """The S3 server's ``Date`` for a HEAD of ``key`` and this clock then (midway); (None, 0) if not S3."""
    client = getattr(store, "client", None)
    if client is None:
        return None, 0.0
    before = clock()
    try:
        head = client.head_object(Bucket=store.bucket, Key=store.prefix + key)  # type: ignore[attr-defined]
    except Exception:  # the clock is a side finding: a failed HEAD must not hide the store's result
        return None, 0.0
    return head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date"), (before + clock()) / 2
