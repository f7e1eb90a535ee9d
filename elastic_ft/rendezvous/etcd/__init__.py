"""The etcd v3 client of the rendezvous: a small adapter over gRPC, one concept a module.

- ``settings``: where etcd is and how to reach it (endpoints, TLS, auth, timeouts).
- ``errors``: the errors raised, and which gRPC faults are transient.
- ``wire``: etcd's messages and methods that we use, by field number (no
  generated code, so no protobuf runtime is forced on the process).
- ``session``: one gRPC channel to one member, TLS and authentication.
- ``failover``: moving between members, bounded retries, the record of outages.
- ``kv``: reads, writes, the compare-and-put transaction, prefix ranges.
- ``watch``: waiting for keys to appear (one read and one watch for many keys).
- ``lease``: the lease every written key is attached to, and one-key leases kept alive
  without writes (the nodes' liveness keys).
- ``client``: :class:`EtcdClient`, the interface the rest of the package uses.

grpcio is imported only when a client first connects.
"""

from .client import EtcdClient
from .errors import EtcdClientError, EtcdLeaseError, EtcdUnavailableError
from .failover import Outage
from .kv import KeyValue
from .settings import ConnectionSettings, Endpoint

__all__ = [
    "ConnectionSettings",
    "Endpoint",
    "EtcdClient",
    "EtcdClientError",
    "EtcdLeaseError",
    "EtcdUnavailableError",
    "KeyValue",
    "Outage",
]
