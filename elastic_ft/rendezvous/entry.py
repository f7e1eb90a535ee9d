"""The ``torchrun.handlers`` entry point ``etcd3``.

pyproject.toml registers ``etcd3 = "elastic_ft.rendezvous.entry:etcd3_handler"``.
torch's rendezvous package loads every entry point of that group when it is
first imported, for every run whatever backend is chosen. This module imports
nothing, so the entry point loads cheaply and never finds one of our modules
half-initialised: whichever of them (the handler, ``lifecycle``, ``liveness``,
...) imports torch's rendezvous package first, etcd3 is registered. The handler
is imported when ``--rdzv-backend=etcd3`` is actually used.
"""

from __future__ import annotations

from typing import Any, Callable


def etcd3_handler() -> Callable[[Any], Any]:
    """Entry point of group ``torchrun.handlers``: returns the handler creator
    (:func:`elastic_ft.rendezvous.handler.create_handler`)."""

    def creator(params: Any) -> Any:
        from elastic_ft.rendezvous.handler import create_handler

        return create_handler(params)

    return creator
