"""The one retry policy every S3 request runs under.

Bounded exponential backoff with jitter, ``max_attempts`` in all, on what
:func:`~elastic_ft.checkpoint.s3.errors.is_transient` calls transient. Each
retry is logged at WARNING with the object's URI and the error (never
credentials); when attempts run out, :class:`StoreUnavailable` states the
count and the object. botocore's own retries are off in the clients
:mod:`~elastic_ft.checkpoint.s3.client` builds, so this policy is the one in
force; a client passed in keeps whatever retry settings its owner gave it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from elastic_ft.checkpoint.errors import StoreUnavailable
from elastic_ft.checkpoint.s3.errors import describe, is_transient

log = logging.getLogger(__name__)

T = TypeVar("T")


def with_retries(
    fn: Callable[[], T], *, what: str, uri: str, max_attempts: int, backoff_initial: float, backoff_max: float
) -> T:
    """Call ``fn`` until it returns, fails for good, or ``max_attempts`` attempts were made.

    ``what`` names the operation for logs ("put", "get part 3", ...) and
    ``uri`` the object. A non-transient error is raised at once, unchanged,
    for the caller to map; a transient one that outlived the attempts becomes
    :class:`StoreUnavailable`.
    """
    import tenacity

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "S3 %s of %s failed (attempt %d of %d: %s); retrying in %.2f s",
            what,
            uri,
            state.attempt_number,
            max_attempts,
            describe(exc) if exc else "unknown error",
            state.next_action.sleep if state.next_action else 0.0,
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(max_attempts),
        # initial * 2**n capped at max, plus up to ``initial`` of jitter so
        # parallel parts that failed together do not retry in lockstep.
        # (Spelled with the two classic waits: wait_exponential_jitter's
        # arguments changed between tenacity 8 and 9.)
        wait=tenacity.wait_exponential(multiplier=backoff_initial, max=backoff_max)
        + tenacity.wait_random(0, backoff_initial),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return retrying(fn)
    except Exception as exc:
        if is_transient(exc):
            attempts = retrying.statistics.get("attempt_number", max_attempts)
            raise StoreUnavailable(
                f"S3 {what} of {uri} failed after {attempts} attempts; last error: {describe(exc)}. "
                "Check the endpoint, network and server health, or raise max_attempts."
            ) from exc
        raise


__all__ = ["with_retries"]
