"""The ``torchrun.handlers`` entry point ``etcd3``: builds the rendezvous handler.

pyproject.toml registers ``etcd3 = "elastic_ft.rendezvous.handler:etcd3_handler"``.
torchrun calls :func:`etcd3_handler` (no arguments) when it loads its
out-of-tree backends, for every run whatever backend is chosen, so it only
returns :func:`create_handler` and imports nothing heavy. ``create_handler``
runs when ``--rdzv-backend=etcd3`` is actually used: it parses ``--rdzv-conf``,
connects to etcd (importing python-etcd3 then; an unreachable endpoint fails
here, as torch's c10d backend fails when its TCPStore does not answer) and
returns torch's own
:class:`DynamicRendezvousHandler` over our backend and store.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable


def etcd3_handler() -> Callable[[Any], Any]:
    """Entry point of group ``torchrun.handlers``: returns the handler creator."""

    def creator(params: Any) -> Any:
        # Looked up at call time: this module may still be importing (see below).
        return create_handler(params)

    return creator


# Defined before the torch imports below on purpose: importing
# torch.distributed.elastic.rendezvous loads every ``torchrun.handlers`` entry
# point, this one included, so when this module is imported first torch finds
# etcd3_handler on the partially initialised module instead of failing.
from torch.distributed.elastic.rendezvous import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

log = logging.getLogger(__name__)

# torch 2.13 otherwise makes the rank-0 agent host a TCPStore shared with the
# workers, so the job's store dies with that node, and a node joining a running
# job hangs (the new round never publishes MASTER_ADDR). With it set, each round
# publishes a fresh MASTER_ADDR/PORT through our etcd store instead.
_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous; the agent's store is etcd, never a node's TCPStore."""

    _etcd_away = False  # whether num_nodes_waiting() last found etcd unreachable

    @property
    def use_agent_store(self) -> bool:
        """Workers must not look for a store on the agent: it lives in etcd."""
        return False

    def num_nodes_waiting(self) -> int:
        """See base class; 0 (no change) while etcd does not answer.

        torch's agent calls this every monitor interval while the workers are
        healthy and lets any error kill the agent and its workers; training
        needs etcd only to change membership, so an outage is logged once and
        the workers go on. Other errors (permissions, corrupt state) raise.
        """
        from .etcd_client import EtcdUnavailableError

        try:
            waiting = super().num_nodes_waiting()
        except RendezvousConnectionError as exc:
            if not isinstance(exc.__cause__, EtcdUnavailableError):
                raise
            if not self._etcd_away:
                log.warning(
                    "etcd is unreachable; the workers of rendezvous %r go on training and "
                    "membership changes wait until etcd answers again (%s)",
                    self._settings.run_id,
                    exc.__cause__,
                )
            self._etcd_away = True
            return 0
        if self._etcd_away:
            log.warning("etcd answers again; rendezvous %r watches membership as before.",
                        self._settings.run_id)
            self._etcd_away = False
        return waiting

    def shutdown(self) -> bool:
        """Close the rendezvous (see base class), then the etcd connection.

        The connection reopens by itself if the handler is used again; closing
        it frees the gRPC channel's threads in processes that build many
        handlers (tests, benchmarks).
        """
        try:
            return super().shutdown()
        finally:
            client = getattr(self._store, "client", None)
            if client is not None:
                client.close()


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler for ``torchrun --rdzv-backend=etcd3``.

    Raises:
        ValueError: an invalid ``--rdzv-conf`` option (all of them listed).
        EtcdClientError: python-etcd3 cannot be imported (protobuf runtime).
        RendezvousConnectionError: no endpoint answered within ``retry_timeout``
            (it names them), or etcd refused the credentials.
    """
    from .backend import EtcdV3RendezvousBackend, connection_error
    from .etcd_client import EtcdClient, EtcdClientError
    from .options import parse_options
    from .outage import OutageTolerantStateHolder
    from .store import EtcdStore

    options = parse_options(params.endpoint, params.config)
    if os.environ.get(_SHARE_STORE_ENV) != "1":
        log.info("Setting %s=1: the etcd3 rendezvous keeps the agents' store in etcd.", _SHARE_STORE_ENV)
        os.environ[_SHARE_STORE_ENV] = "1"

    client = EtcdClient(options.connection, name=params.run_id)
    try:
        client.open()
    except EtcdClientError as exc:
        raise connection_error(exc) from exc
    run_prefix = options.run_prefix(params.run_id)
    backend = EtcdV3RendezvousBackend(client, params.run_id, run_prefix)
    store = EtcdStore(client, run_prefix + "store/")
    timeout = RendezvousTimeout(
        join=options.join_timeout,
        last_call=options.last_call_timeout,
        close=options.close_timeout,
        heartbeat=options.heartbeat_timeout,
    )
    handler = EtcdRendezvousHandler.from_backend(
        run_id=params.run_id,
        store=store,
        backend=backend,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        timeout=timeout,
        keep_alive_interval=options.keep_alive_interval,
        keep_alive_max_attempt=options.keep_alive_max_attempt,
    )
    # torch builds its own state holder; ours (same state, same backend) also
    # rides out etcd outages. The op executor holds it too.
    holder = OutageTolerantStateHolder(backend, handler._settings, lambda: client.last_outage)
    handler._state_holder = handler._op_executor._state_holder = holder
    return handler
