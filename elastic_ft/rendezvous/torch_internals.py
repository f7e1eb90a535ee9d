"""torch's private rendezvous names, used here and nowhere else, and checked when this module is imported.

torch 2.13's dynamic rendezvous exposes only ``settings``, ``from_backend`` and
the ``RendezvousHandler`` methods. What the etcd3 handler adds (a lost node
survived, a closed rendezvous reopened, a round closed early after a leave,
an etcd outage ridden out) needs its state, its operation protocol and a few
of its hooks, which have no public counterparts. Each such name is reached
through this module only, under a public name of ours:

- classes: :data:`Action`, :data:`RendezvousContext`, :data:`RendezvousState`,
  :data:`RendezvousJoinOp`, and :class:`StateHolder` (torch's
  ``_BackendRendezvousStateHolder`` with named hooks instead of ``_sanitize``,
  ``_state``, ``_token`` and ``_dirty``);
- a handler's private attributes: :func:`state_holder`, :func:`heartbeat_lock`,
  :func:`this_node`, :func:`op_executor`, :func:`stop_heartbeats`,
  :func:`install_state_holder`, :func:`wrap_op_executor`;
- the hook torch calls once a round completes (``_get_store``):
  :class:`HandlerBase` turns it into :meth:`HandlerBase.on_round_complete`.

:func:`check` runs at import: each name must exist, each method must take
the parameters it is called with, each private attribute must still be set
by the constructor that sets it today. A torch whose internals changed then
fails at the first import of the rendezvous with :class:`TorchInternalsChanged`,
one line per difference, instead of an AttributeError in the middle of a
round. Costs nothing per round: a few attribute reads at import.
"""

from __future__ import annotations

import inspect
import threading
from types import ModuleType
from typing import Any, Callable

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr


class TorchInternalsChanged(ImportError):
    """The installed torch lacks (or changed) a private rendezvous name elastic_ft relies on."""


# Methods called or overridden: their parameters, in order (self included).
_SIGNATURES = {
    ("DynamicRendezvousHandler", "_get_store"): ("self",),
    ("DynamicRendezvousHandler", "_stop_heartbeats"): ("self",),
    ("_BackendRendezvousStateHolder", "__init__"): ("self", "backend", "settings", "cache_duration"),
    ("_BackendRendezvousStateHolder", "_sanitize"): ("self",),
    ("_BackendRendezvousStateHolder", "sync"): ("self",),
    ("_BackendRendezvousStateHolder", "mark_dirty"): ("self",),
    ("_DistributedRendezvousOpExecutor", "run"): ("self", "state_handler", "deadline", "update_deadline"),
    ("_RendezvousJoinOp", "__call__"): ("self", "ctx", "deadline"),
}

# Private attributes read on instances: the constructor that must still assign each.
_ASSIGNED = {
    "DynamicRendezvousHandler": ("_this_node", "_state_holder", "_op_executor", "_heartbeat_lock"),
    "_BackendRendezvousStateHolder": ("_state", "_token", "_dirty"),
    "_DistributedRendezvousOpExecutor": ("_state_holder",),
    "_RendezvousContext": ("node", "state", "settings"),
    "_RendezvousState": ("round", "complete", "deadline", "closed", "participants", "wait_list",
                         "redundancy_list", "last_heartbeats"),
}

_ACTIONS = ("SYNC", "MARK_RENDEZVOUS_COMPLETE", "REMOVE_FROM_PARTICIPANTS", "REMOVE_FROM_WAIT_LIST",
            "REMOVE_FROM_REDUNDANCY_LIST", "FINISH", "ERROR_TIMEOUT")


def problems(module: ModuleType = _dr) -> list[str]:
    """What ``module`` (torch's ``dynamic_rendezvous``) lacks or changed of what we use; empty if nothing."""
    where = module.__name__
    found = []
    for cls_name, method in _SIGNATURES:
        cls = getattr(module, cls_name, None)
        if cls is None:
            continue  # reported below, once per class
        fn = getattr(cls, method, None)
        if fn is None:
            found.append(f"{where}.{cls_name}.{method} is gone")
            continue
        got = tuple(inspect.signature(fn).parameters)
        if got != _SIGNATURES[cls_name, method]:
            found.append(f"{where}.{cls_name}.{method} takes {got}, expected {_SIGNATURES[cls_name, method]}")
    for cls_name in sorted({c for c, _ in _SIGNATURES} | set(_ASSIGNED) | {"_Action"}):
        if getattr(module, cls_name, None) is None:
            found.append(f"{where}.{cls_name} is gone")
    for cls_name, attrs in _ASSIGNED.items():
        init = getattr(getattr(module, cls_name, None), "__init__", None)
        assigned = set(getattr(getattr(init, "__code__", None), "co_names", ()))
        missing = [a for a in attrs if a not in assigned]
        if hasattr(module, cls_name) and missing:
            found.append(f"{where}.{cls_name}.__init__ no longer sets {', '.join(missing)}")
    action = getattr(module, "_Action", None)
    if action is not None:
        gone = [a for a in _ACTIONS if not hasattr(action, a)]
        if gone:
            found.append(f"{where}._Action lacks {', '.join(gone)}")
    return found


def check(module: ModuleType = _dr) -> None:
    """Raise :class:`TorchInternalsChanged` naming every difference :func:`problems` finds."""
    found = problems(module)
    if found:
        import torch

        raise TorchInternalsChanged(
            f"elastic_ft's etcd3 rendezvous relies on private names of torch's dynamic rendezvous that torch "
            f"{torch.__version__} changed (elastic_ft is tested with torch 2.13): " + "; ".join(found)
        )


check()

Action = _dr._Action
"""What a rendezvous operation asks the executor to do next."""
RendezvousContext = _dr._RendezvousContext
"""What an operation is given: this node, the state, the settings."""
RendezvousState = _dr._RendezvousState
"""The rendezvous state every node shares (round, participants, heartbeats, ...)."""
RendezvousJoinOp = _dr._RendezvousJoinOp
"""torch's join operation, which ``next_rendezvous`` runs."""


def state_holder(handler: _dr.DynamicRendezvousHandler) -> Any:
    """The handler's state holder (the state last synced, ``sync()``, ``mark_dirty()``)."""
    return handler._state_holder


def heartbeat_lock(handler: _dr.DynamicRendezvousHandler) -> threading.Lock:
    """The lock under which torch's keep-alive thread syncs the state holder."""
    return handler._heartbeat_lock


def this_node(handler: _dr.DynamicRendezvousHandler) -> Any:
    """This node's descriptor in the state."""
    return handler._this_node


def op_executor(handler: _dr.DynamicRendezvousHandler) -> Any:
    """The executor that runs operations (``run(op, deadline)``) on the state."""
    return handler._op_executor


def stop_heartbeats(handler: _dr.DynamicRendezvousHandler) -> None:
    """Stop the keep-alive thread (what ``shutdown()`` does before closing, without the close)."""
    handler._stop_heartbeats()


def install_state_holder(handler: _dr.DynamicRendezvousHandler, holder: Any) -> None:
    """Make ``holder`` the state holder of the handler and of its op executor (``from_backend`` takes none)."""
    handler._state_holder = handler._op_executor._state_holder = holder


def wrap_op_executor(handler: _dr.DynamicRendezvousHandler, wrap: Callable[[Any], Any]) -> None:
    """Replace the handler's op executor with ``wrap(executor)``."""
    handler._op_executor = wrap(handler._op_executor)


class StateHolder(_dr._BackendRendezvousStateHolder):
    """torch's backend state holder, its private hooks under public names for a subclass."""

    def key_found(self) -> bool:
        """Whether the last sync found the state key (torch keeps no token when it was absent)."""
        return self._token is not None

    def restore(self, state: RendezvousState) -> None:
        """Make ``state`` the state held (the ``state`` property has no setter); mark it dirty to write it."""
        self._state = state

    def dirty(self) -> bool:
        """Whether the state held has changes the next sync writes (torch's ``mark_dirty`` since the last sync)."""
        return self._dirty

    def may_drop_stale_nodes(self) -> bool:
        """Whether torch may drop nodes with stale heartbeats at this sync (default: always)."""
        return True

    def on_synced(self) -> None:
        """Called by every sync that read or wrote the state, once it is loaded, before stale nodes are
        dropped (default: nothing)."""

    def _sanitize(self) -> None:
        # torch's hook at every sync: it drops nodes whose heartbeat is older than the keep-alive expiry.
        self.on_synced()
        if self.may_drop_stale_nodes():
            super()._sanitize()


class HandlerBase(_dr.DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler, with its round-complete hook under a public name."""

    def on_round_complete(self) -> None:
        """Called once a round is complete, before torch hands out the round's store (default: nothing)."""

    def _get_store(self) -> Store:
        # torch calls this private hook exactly once per completed round.
        self.on_round_complete()
        return super()._get_store()


__all__ = [
    "Action", "HandlerBase", "RendezvousContext", "RendezvousJoinOp", "RendezvousState", "StateHolder",
    "TorchInternalsChanged", "check", "heartbeat_lock", "install_state_holder", "op_executor", "problems",
    "state_holder", "stop_heartbeats", "this_node", "wrap_op_executor",
]


_AGENT_WRAPPED = "_elastic_ft_wrapped"


def wrap_agent_rendezvous(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace torch's ``SimpleElasticAgent._rendezvous(self, worker_group)`` by ``wrap(original)``, once per process.

    Returns False, changing nothing, on a torch whose agent lacks that method or
    changed its parameters: wrapping blindly could break every agent.
    """
    import functools

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    original = getattr(SimpleElasticAgent, "_rendezvous", None)
    if getattr(original, _AGENT_WRAPPED, False):
        return True
    if original is None or list(inspect.signature(original).parameters) != ["self", "worker_group"]:
        return False
    wrapped = functools.wraps(original)(wrap(original))
    setattr(wrapped, _AGENT_WRAPPED, True)
    SimpleElasticAgent._rendezvous = wrapped  # type: ignore[method-assign]
    return True

