"""The ``torchrun.handlers`` entry point ``etcd3``.

pyproject.toml registers ``etcd3 = "elastic_ft.rendezvous.entry:etcd3_handler"``.
torch's rendezvous package loads every entry point of that group when it is
first imported, for every run whatever backend is chosen. This module imports
nothing, so the entry point loads cheaply and never finds one of our modules
half-initialised: whichever of them (the handler, ``lifecycle``, ``liveness``,
...) imports torch's rendezvous package first, etcd3 is registered. The handler
is imported when ``--rdzv-backend=etcd3`` is actually used.

A node that cannot start its rendezvous (etcd unreachable past ``retry_timeout``,
credentials refused, an invalid ``--rdzv-conf``) ends here with one line on
stderr and an exit status, not with torchrun's traceback (torchrun re-raises
any error from handler creation, and torchx shows it again):

- 69 (``EX_UNAVAILABLE``): no etcd endpoint answered within ``retry_timeout``.
- 78 (``EX_CONFIG``): etcd refused the connection as configured (credentials,
  TLS, permissions) or a rendezvous option is invalid.

Neither is 75 (:data:`elastic_ft.handoff.leave_marker.RECLAIM_EXIT_CODE`), the only status
AWS Batch retries under :mod:`elastic_ft.aws_batch.retry`: the client already
retried transient faults for ``retry_timeout``, and a wrong endpoint or
password retried as a reclaimed node would cost every attempt (up to 10) its
own wait and then fail the same way. Both are also not torchrun's 1 (the
workers failed), so a script or a scheduler rule can tell them apart.
"""

from __future__ import annotations

from typing import Any, Callable

UNAVAILABLE_EXIT_CODE = 69
CONFIG_EXIT_CODE = 78


def etcd3_handler() -> Callable[[Any], Any]:
    """Entry point of group ``torchrun.handlers``: returns the handler creator
    (:func:`elastic_ft.rendezvous.handler.create_handler`)."""

    def creator(params: Any) -> Any:
        from elastic_ft.rendezvous.handler import create_handler
        from elastic_ft.rendezvous.options import parse_options
        from torch.distributed.elastic.rendezvous import RendezvousConnectionError

        try:
            # Parsed here first (pure, cheap; create_handler parses again) so that only the
            # options' ValueError becomes one line: any other one is a bug, whose traceback must show.
            parse_options(params.endpoint, params.config)
        except ValueError as exc:
            _exit_without_traceback(params, exc)
        try:
            return create_handler(params)
        except RendezvousConnectionError as exc:
            _exit_without_traceback(params, exc)

    return creator


def _exit_without_traceback(params: Any, exc: Exception) -> None:
    """Print what went wrong as one line and exit with its status (see the module docstring).

    SystemExit passes torchrun's ``@record`` (it re-raises a nonzero one) and
    Python ends quietly with its code.
    """
    import sys

    from elastic_ft.rendezvous.etcd import EtcdUnavailableError

    unreachable = isinstance(exc.__cause__, EtcdUnavailableError)
    code = UNAVAILABLE_EXIT_CODE if unreachable else CONFIG_EXIT_CODE
    text = " ".join(str(exc).split())  # one line, whatever the message holds
    print(f"elastic_ft: rendezvous {params.run_id!r} could not start on this node: {text} "
          f"(exit status {code})", file=sys.stderr, flush=True)
    raise SystemExit(code)
