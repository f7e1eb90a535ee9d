"""Rendezvous on etcd v3 for torch elastic: backend, store, handler factory."""
