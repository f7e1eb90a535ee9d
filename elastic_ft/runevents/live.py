"""The run's current world, read from its etcd rendezvous without unpickling anything.

torch's rendezvous state in etcd is a pickle, which we never load from
storage. But each round's agents leave JSON in the run's store (etcd keys
under ``<key_prefix>/<run_id>/store/``, on their agents' leases, so they go
when the agents do): torch's agent writes ``torchelastic/role_info/<node>``
(one per node) and its node 0 ``torchelastic/assigned_ranks/<node>``
(``[first rank, world size, ...]``), under the round's prefix
``torch.rendezvous.<run_id>.<round>/``. The newest round with them is the
world now training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from elastic_ft.runevents.status import LiveWorld


def world_from_keys(prefix: str, run_id: str, keys: Sequence[str], assigned: Mapping[str, bytes]) -> LiveWorld | None:
    """The newest round's world from the store's ``keys`` and the ``assigned_ranks`` values read; None if none."""
    pattern = re.compile(re.escape(f"{prefix}torch.rendezvous.{run_id}.") + r"(\d+)/torchelastic/(role_info|assigned_ranks)/(\d+)$")
    rounds: dict[int, dict[str, list[str]]] = {}
    for key in keys:
        m = pattern.match(key)
        if m:
            rounds.setdefault(int(m.group(1)), {}).setdefault(m.group(2), []).append(key)
    for r in sorted(rounds, reverse=True):
        for key in rounds[r].get("assigned_ranks", []):
            try:
                size = json.loads(assigned[key])[1]
            except (KeyError, ValueError, IndexError, TypeError):
                continue
            if isinstance(size, int):
                return LiveWorld(round=r, world=size, nodes=len(rounds[r].get("role_info", [])))
    return None


def live_world(endpoint: str, conf: str | None, run_id: str) -> LiveWorld | None:
    """The run's newest round in the etcd at ``endpoint`` (``--rdzv_conf`` options as torchrun's), or None.

    Raises ValueError for bad options and the etcd client's errors when etcd does not answer.
    """
    from elastic_ft.rendezvous.probe import open_client, parse_conf

    options, client = open_client(endpoint, parse_conf(conf))
    try:
        prefix = options.run_prefix(run_id) + "store/"
        keys = client.keys_under(prefix)
        wanted = [k for k in keys if "/torchelastic/assigned_ranks/" in k]
        values = {k: kv.value for k, kv in zip(wanted, client.get_many(wanted)) if kv is not None}
        return world_from_keys(prefix, run_id, keys, values)
    finally:
        client.close()
