"""The meeting that ends a round: every participant returns from the rendezvous only once all have reached it.

A node lost between the round completing and the agents' rank assignment
would leave the others waiting in torch's agent for its keys, where a failure
ends the agent. The handler (:mod:`elastic_ft.rendezvous.handler`) has its
members meet on the run's etcd store first, whose writer check ends the wait
with :class:`~elastic_ft.rendezvous.store.WritersLostError` once a member is
lost, and starts a new round on it.

Keys (under the run's store prefix, on the writers' leases like torch's own):
``elastic_ft/met/<meeting>/<rank>`` per member and ``elastic_ft/met-all/<meeting>``
once all are in, ``<meeting>`` being :func:`meeting_of` the round and its
members. Cost: two writes, one count and one wait per member, whatever the
node count (a count is one request; reading N keys would take a transaction
per 128 of them, etcd's ``--max-txn-ops``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Any

from .store import EtcdStore

MET_PREFIX = "elastic_ft/met/"
MET_ALL = "elastic_ft/met-all/"


def meeting_of(round_: int, members: Collection[Any]) -> str:
    """The name of the meeting that ends round ``round_`` of ``members`` (node descriptors: host, pid and
    local id), the same on every member. The members are part of it because a round number alone can repeat:
    a rendezvous state that expired (it lives on its last writer's lease) starts again at round 0 while an
    earlier job's meeting keys, on other agents' leases, may still be there to open a barrier too early."""
    digest = hashlib.sha256("\n".join(sorted(map(str, members))).encode()).hexdigest()[:16]
    return f"{round_}-{digest}"


def meet(store: EtcdStore, round_: int, members: Collection[Any], rank: int) -> None:
    """Return once every one of ``members`` (this node is ``rank`` among them) reached round ``round_``.

    On the etcd store itself, not through torch's PrefixStore: counting needs the keys' full prefix.
    Raises the store's errors: ``DistStoreError`` at its timeout, ``WritersLostError`` once a member is lost.
    """
    meeting = meeting_of(round_, members)
    met = f"{MET_PREFIX}{meeting}/"
    store.set(f"{met}{rank}", b"1")
    # The member whose key etcd stored last counts all N (each read follows its own write, and etcd reads are
    # linearizable) and opens the barrier: the others wait for that one key, since N members each watching N
    # keys cost etcd N*N events.
    if store.num_keys_under(met) >= len(members):
        store.set(f"{MET_ALL}{meeting}", b"1")
    store.wait([f"{MET_ALL}{meeting}"])
