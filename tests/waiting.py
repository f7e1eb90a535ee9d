"""Waiting in tests: the one poll loop with a deadline (a test never sleeps in place of a condition).

Every wait of the suite goes through :func:`wait_until`: servers coming up, processes reaching a
step, a key expiring. ``tests/rendezvous/agents.py`` (``wait_for``: fails as soon as an agent exits)
and ``tests/chaos/cluster.py`` (the nodes' log tails) only add what their failure message needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, timeout: float, what: str, interval: float = 0.1,
               check: Callable[[], None] | None = None, on_timeout: Callable[[], str] | None = None,
               retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Args:
        timeout: seconds before the wait fails with an ``AssertionError`` naming ``what``.
        interval: seconds between polls.
        check: called after each poll that found nothing; it raises to end the wait early (what was
            to bring the condition about has died: waiting out the timeout would only hide why).
        on_timeout: called once when the time is up; returns text for the failure (log tails) and
            may stop what was waited on to collect it.
        retry_on: exceptions from ``condition`` that mean "not yet" (a server still starting); the
            last one is named in the failure. Any other exception ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = condition()
        except retry_on as exc:
            last, value = exc, None
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() > deadline:
            message = f"timed out after {timeout:g} s waiting for {what}"
            if last is not None:
                message += f" (last error: {last!r})"
            if on_timeout is not None:
                message += "\n" + on_timeout()
            raise AssertionError(message)
        time.sleep(interval)
