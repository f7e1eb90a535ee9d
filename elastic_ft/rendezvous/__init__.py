"""Rendezvous on etcd v3 for torch elastic: backend, store, handler factory.

``torchrun --rdzv-backend=etcd3 --rdzv-endpoint=HOST:2379 --rdzv-id=RUN ...``
finds :func:`elastic_ft.rendezvous.entry.etcd3_handler` through the
``torchrun.handlers`` entry point. The modules, one concept each:

- ``options``: the ``--rdzv-conf`` options, validated into one dataclass.
- ``etcd``: the package that talks to etcd (its gRPC API, imported lazily;
  retries, failover, TLS and auth, the lease), behind one ``EtcdClient``.
- ``backend``: torch's ``RendezvousBackend``, the state as one key with
  compare-and-set on its revision.
- ``state_codec``: how that state is written in etcd (HMAC-SHA256 with the
  job's key, base64), so that a value that does not verify is refused before
  torch unpickles it.
- ``store``: a ``torch.distributed.Store`` in etcd for the agents' bootstrap.
- ``handler``: builds torch's ``DynamicRendezvousHandler`` from those.

Nothing is imported here, so loading the entry point stays cheap.
"""
