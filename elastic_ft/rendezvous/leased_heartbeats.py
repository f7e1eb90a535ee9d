"""Keep-alives as etcd leases: a node's heartbeat refreshes a lease instead of rewriting the shared state.

torch's dynamic rendezvous keeps every node's last heartbeat in the one state
it shares (``last_heartbeats``), and its keep-alive op rewrites that state (a
compare-and-set of the one etcd key, whose value holds every node) every
``keep_alive_interval`` per node: O(N) bytes per write, N writers, one new etcd
revision each, so the bytes written per second grow with N squared.

Here each node instead holds a lease of its own (TTL: torch's keep-alive
expiry, ``keep_alive_interval * keep_alive_max_attempt``, rounded up to whole
seconds) with the key ``<run prefix>alive/<node>`` attached, refreshed by a
LeaseKeepAlive (no write, no revision, a few bytes). torch's keep-alive op
still runs unchanged; what changes is how its state is synced
(:class:`LeasedHeartbeatHolder`):

- **Reading**: the backend reads the state key and the names of the liveness
  keys in one transaction. A node with a heartbeat in the state whose
  liveness key exists is alive as of now (its lease was refreshed within the
  TTL); this node's own heartbeat reads as its last refresh, so that torch's
  keep-alive op still fires every interval. A node whose key is gone keeps
  the heartbeat stored in the state (its last write of the state), so torch's
  sanitizer and :mod:`~elastic_ft.rendezvous.liveness` expire it as before:
  a silent node is lost when its lease expires (at most the TTL after its
  last refresh, plus etcd's expiry check, about 0.5 s).
- **Writing**: a sync whose only change is this node's own heartbeat (torch's
  KEEP_ALIVE action and nothing else, not even a node the sanitizer dropped)
  refreshes the lease and reads the state (torch's holder serves no other
  read for a second after any sync, so a keep-alive must read); any other change is
  written by compare-and-set as before, with the heartbeats of the other
  nodes put back to what the state stored (what this node read through their
  liveness keys is not a heartbeat they wrote).

So the state key changes only when the membership does. The liveness keys
are written once per node (and again when a lease was lost). Per keep-alive:
one LeaseKeepAlive per node, O(1) bytes; reads list N key names (no values),
as they already read the N-node state. Costs per sync nothing beyond one pass
over the heartbeats.

An etcd outage: while etcd is away nothing expires (its leases are extended
when it restarts). If leases did expire (etcd unreachable but running, or
its data lost), every node's key is gone at once; the outage grace of
:mod:`~elastic_ft.rendezvous.outage` keeps every node for a while, in which
each node's next keep-alive finds its own heartbeat old, grants a new lease
and puts its key again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Collection

from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, RendezvousSettings

# torch's state holder is the only place that reads and writes the state for every node
# operation, and torch offers no public holder or hook to subclass: the adapter's.
from .torch_internals import RendezvousState, StateHolder

log = logging.getLogger(__name__)

ALIVE_DIR = "alive/"
"""The liveness keys of a run live under ``<run prefix>alive/``."""


def alive_name(node: Any) -> str:
    """The name of ``node``'s liveness key under :data:`ALIVE_DIR` (torch's node descriptor as text:
    ``addr_pid_localid``)."""
    return str(node)


def lease_ttl(settings: RendezvousSettings) -> int:
    """Seconds a node's liveness key outlives its last refresh: torch's keep-alive expiry, rounded up."""
    expiry = (settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds()
    return max(1, int(-(-expiry // 1)))


def liveness_lease(client: Any, run_prefix: str, node: Any, settings: RendezvousSettings) -> tuple[Any, str]:
    """``node``'s liveness lease on ``client`` (an :class:`~elastic_ft.rendezvous.etcd.EtcdClient`) and the
    prefix of the run's liveness keys: what the backend's ``use_liveness_keys`` takes."""
    prefix = run_prefix + ALIVE_DIR
    return client.key_lease(prefix + alive_name(node), lease_ttl(settings)), prefix


@dataclass
class Overlay:
    """What :func:`overlay_heartbeats` changed in a state's heartbeats."""

    given: dict = field(default_factory=dict)
    """node -> (the heartbeat given, the one the state stored), for each node changed."""
    lapsed: dict = field(default_factory=dict)
    """node -> its stored heartbeat, for each other node with a heartbeat but no liveness key."""


def overlay_heartbeats(
    beats: dict, alive: Collection[str], own: Any, own_refreshed: datetime | None, now: datetime
) -> Overlay:
    """Make ``beats`` (a state's ``last_heartbeats``, changed in place) say what the liveness keys say.

    A node whose key is in ``alive`` was alive within its lease's TTL: its
    heartbeat becomes ``now``; ``own``'s becomes its last refresh
    (``own_refreshed``), so that its keep-alive comes due as torch expects. A
    node without a key keeps its stored heartbeat (listed in ``lapsed``, but
    ``own``). No heartbeat moves back in time; no node is added.
    """
    overlay = Overlay()
    for node, stored in list(beats.items()):
        if alive_name(node) not in alive:
            if node != own:
                overlay.lapsed[node] = stored
            continue
        given = (stored if own_refreshed is None else max(stored, own_refreshed)) if node == own else max(stored, now)
        if given != stored:
            beats[node] = given
            overlay.given[node] = (given, stored)
    return overlay


def restore_stored(beats: dict, given: dict, own: Any) -> None:
    """Put back the stored heartbeat of every other node whose heartbeat is still the one
    :func:`overlay_heartbeats` gave (``given``), before the state is written."""
    for node, (overlaid, stored) in given.items():
        if node != own and beats.get(node) == overlaid:
            beats[node] = stored


def fingerprint(state: RendezvousState, own: Any) -> tuple:
    """Everything of ``state`` but ``own``'s heartbeat time, comparable with ``==``."""
    beats = {n: b for n, b in state.last_heartbeats.items() if n != own}
    return (state.round, state.complete, state.deadline, state.closed, dict(state.participants),
            frozenset(state.wait_list), frozenset(state.redundancy_list), beats, own in state.last_heartbeats)


def only_own_heartbeat_changed(before: tuple | None, state: RendezvousState, own: Any) -> bool:
    """Whether ``state`` differs from ``before`` (``(fingerprint, own heartbeat)`` when last synced)
    in ``own``'s heartbeat only."""
    if before is None or own not in state.last_heartbeats:
        return False
    print_before, beat_before = before
    return state.last_heartbeats[own] != beat_before and fingerprint(state, own) == print_before


class LeasedHeartbeatHolder(StateHolder):
    """torch's state holder whose keep-alives are lease refreshes (see the module docstring).

    Without ``node`` (or with a backend that reads no liveness keys) it is
    torch's holder unchanged.

    Args:
        backend: the rendezvous backend; it reads the liveness keys (its
            ``alive``) and turns a write it was told to expect
            (``expect_heartbeat``) into a lease refresh.
        settings: torch's rendezvous settings.
        node: this node's descriptor.
    """

    def __init__(self, backend: RendezvousBackend, settings: RendezvousSettings, node: Any = None) -> None:
        super().__init__(backend, settings)
        self.rdzv_backend = backend  # our own reference, not torch's private _backend
        self.node = node
        self.lapsed: dict = {}
        """Other nodes with a heartbeat in the state as last read but no liveness key: their stored
        heartbeat (for :mod:`~elastic_ft.rendezvous.liveness`, which must not count such a node as
        seen now)."""
        self._given: dict = {}
        self._ever_alive: set[str] = set()
        self._synced: tuple | None = None
        self._own_refreshed: datetime | None = None

    @property
    def leased(self) -> bool:
        """Whether heartbeats go through liveness leases here."""
        return self.node is not None and getattr(self.rdzv_backend, "alive", None) is not None

    def lease_gone(self, node: Any) -> bool:
        """Whether ``node``'s liveness key was read before and is gone at the last read: its lease
        expired (no refresh for its TTL, the keep-alive expiry) or it shut down."""
        alive = self.rdzv_backend.alive if self.leased else None
        name = alive_name(node)
        return alive is not None and name in self._ever_alive and name not in alive

    def sync(self) -> bool | None:
        """See base class; a change of this node's heartbeat alone refreshes its lease."""
        if not (self.leased and self.dirty()):
            return super().sync()
        state = self.state
        if self.key_found() and only_own_heartbeat_changed(self._synced, state, self.node):
            previous, self._own_refreshed = self._own_refreshed, state.last_heartbeats[self.node]
            self.rdzv_backend.expect_heartbeat(True)
            try:
                return super().sync()
            except BaseException:
                self._own_refreshed = previous
                raise
            finally:
                self.rdzv_backend.expect_heartbeat(False)
        restore_stored(state.last_heartbeats, self._given, self.node)
        return super().sync()

    def on_synced(self) -> None:
        """See base class: overlay the liveness keys read with the state, and remember what was synced."""
        if not self.leased:
            return
        state = self.state
        self._ever_alive |= self.rdzv_backend.alive
        overlay = overlay_heartbeats(state.last_heartbeats, self.rdzv_backend.alive, self.node,
                                     self._own_refreshed, datetime.now(timezone.utc))
        self._given, self.lapsed = overlay.given, overlay.lapsed
        self._synced = (fingerprint(state, self.node), state.last_heartbeats.get(self.node))


def release_liveness(holder: Any) -> None:
    """Delete the liveness key of ``holder``'s node (a node that shuts down); if etcd does not
    answer, its lease expires by itself."""
    release = getattr(getattr(holder, "rdzv_backend", None), "release_liveness", None)
    if release is None:
        return
    try:
        release()
    except RendezvousError as exc:
        log.info("Node %s: its liveness key expires by itself (%s).", getattr(holder, "node", None), exc)
