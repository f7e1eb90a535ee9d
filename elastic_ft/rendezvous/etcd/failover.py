"""Failover between etcd members, bounded retries, and the record of outages.

Transient faults (member down, leader change, connection reset, deadline
exceeded) are retried with a bounded, logged exponential backoff, moving to the
next endpoint each time. A run of failures longer than ``retry_timeout`` ends
in :class:`~.errors.EtcdUnavailableError`, whose message names every endpoint
tried and the attempt count. The first failure of an outage is logged as a
warning, later retries (of any call, any thread) at DEBUG level until etcd
answers again, which is logged once and kept as :attr:`Failover.last_outage`
(the rendezvous uses it to keep nodes whose heartbeats the outage held up).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, TypeVar

import tenacity

from .errors import (
    AuthTokenExpired,
    EtcdClientError,
    EtcdUnavailableError,
    describe,
    grpc_details,
    hint,
    is_auth_token_error,
    is_transient,
)
from .settings import ConnectionSettings, Endpoint

log = logging.getLogger(__name__)

T = TypeVar("T")

_QUIET = " (until it answers, further failures are logged at DEBUG level)."


@dataclass(frozen=True)
class Outage:
    """A span of wall-clock time (``time.time()``) in which etcd did not answer this client."""

    started: float
    """When etcd last answered before the failures began."""

    ended: float
    """When etcd answered again."""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class Failover:
    """The session to the member in use, replaced on faults, and calls retried through it.

    Args:
        settings: endpoints, TLS, credentials and timeouts.
        name: a label for log and error messages (the run id).
    """

    def __init__(self, settings: ConnectionSettings, name: str) -> None:
        if not settings.endpoints:
            raise ValueError("At least one etcd endpoint is required.")
        self.settings = settings
        self.name = name
        self.lock = threading.RLock()
        self._endpoint_index = 0
        self._session: Any = None
        # Wall-clock times, comparable with the rendezvous heartbeats.
        self._last_answer_at = time.time()
        self._failing_since: float | None = None
        self._last_outage: Outage | None = None
        self._logged_failure_since: float | None = None

    @property
    def endpoint(self) -> Endpoint:
        """The member currently in use."""
        return self.settings.endpoints[self._endpoint_index]

    @property
    def last_outage(self) -> Outage | None:
        """The latest run of transient failures that etcd has since ended by answering."""
        return self._last_outage

    def session(self) -> Any:
        """The :class:`~.session.Session` in use, connecting (and authenticating) if there is none."""
        with self.lock:
            if self._session is None:
                from .session import Session

                self._session = Session(self.endpoint, self.settings)
            return self._session

    def drop(self, failover: bool) -> None:
        """Close the session; with ``failover``, the next one goes to the next member."""
        with self.lock:
            if self._session is not None:
                try:
                    self._session.close()
                except Exception:  # closing a broken channel may fail; it is gone anyway
                    pass
                self._session = None
            if failover and len(self.settings.endpoints) > 1:
                self._endpoint_index = (self._endpoint_index + 1) % len(self.settings.endpoints)

    def _attempt(self, fn: Callable[[Any], T]) -> T:
        """One try of ``fn(session)``, turning connection faults into reconnects."""
        try:
            result = fn(self.session())
        except Exception as exc:
            if is_transient(exc) and self._failing_since is None:
                with self.lock:
                    if self._failing_since is None:
                        self._failing_since = self._last_answer_at
            if is_auth_token_error(exc):
                # A new session authenticates again.
                self.drop(failover=False)
                raise AuthTokenExpired(grpc_details(exc)) from exc
            if is_transient(exc):
                self.drop(failover=True)
            raise
        self._answered()
        return result

    def _answered(self) -> None:
        """Note that etcd answered; the end of an outage is logged once and kept."""
        now = time.time()
        self._last_answer_at = now
        if self._failing_since is None:
            return
        with self.lock:
            started, self._failing_since = self._failing_since, None
            if started is None:
                return
            self._last_outage = Outage(started, now)
        log.warning(
            "etcd answers %r again at %s, %.1f s after its last answer before the failures.",
            self.name,
            self.endpoint,
            now - started,
        )

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(session)`` with bounded retries of transient faults.

        Raises :class:`EtcdUnavailableError` after ``retry_timeout`` seconds of
        transient faults, :class:`EtcdClientError` at once for the others.
        """
        try:
            # The first try without tenacity's bookkeeping: a rendezvous of many
            # nodes is CPU-bound on small machines, and this is its hot path.
            return self._attempt(fn)
        except Exception as exc:
            if not is_transient(exc):
                self._raise_final(what, exc, attempts=1)
            first: Exception | None = exc
        attempts = 1

        def attempt() -> T:
            # tenacity's attempt 1 is the failure above, so it logs and backs off first.
            nonlocal attempts, first
            if first is not None:
                failed, first = first, None
                raise failed
            attempts += 1
            return self._attempt(fn)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_delay(self.settings.retry_timeout),
            wait=tenacity.wait_exponential(multiplier=0.1, max=2.0),
            before_sleep=lambda state: self._log_retry(what, state),
            reraise=True,
        )
        try:
            return retrying(attempt)
        except Exception as exc:
            self._raise_final(what, exc, attempts)

    def _log_retry(self, what: str, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        # While etcd is down every call of every thread retries: one
        # warning per call would flood the agent's log every few seconds.
        first = self._logged_failure_since != self._failing_since
        self._logged_failure_since = self._failing_since
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "etcd %s for %r failed (attempt %d, %s: %s); retrying on %s" + (_QUIET if first else "."),
            what,
            self.name,
            state.attempt_number,
            type(exc).__name__,
            describe(exc),
            self.endpoint,
        )

    def _raise_final(self, what: str, exc: Exception, attempts: int) -> NoReturn:
        """Raise the error ``call`` ends with when ``exc`` failed the last of ``attempts`` tries."""
        if is_transient(exc):
            raise EtcdUnavailableError(
                f"etcd {what} failed: no etcd endpoint ({self.settings.endpoints_text}) "
                f"answered after {attempts} attempts over {self.settings.retry_timeout:g} s "
                f"(last error: {describe(exc)}). Check that etcd is running and reachable at "
                f"that address, and that the TLS options match the server."
            ) from exc
        if isinstance(exc, (EtcdClientError, ValueError)):
            raise exc
        raise EtcdClientError(f"etcd {what} at {self.endpoint} failed: {describe(exc)}. {hint(exc)}") from exc
