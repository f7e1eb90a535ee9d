"""Warm worker starts: a per-node process that imported the libraries once, and forks ready workers.

torchrun restarts every worker at every membership change, and a worker's own
start (``import torch, transformers, peft`` and the trainer's modules) costs
seconds of CPU each time, on every rank of every node, growing with nothing
the job decides. Here, torchrun still starts a process per worker
(``python -m elastic_ft.worker``, as it always did) and still watches and stops
it; that process is a small launcher (:mod:`~elastic_ft.warm.client`, standard
library only) which asks the node's warm process (:mod:`~elastic_ft.warm.server`,
one per torchrun agent, started by the first launcher that finds none) for a
fork of itself, hands it its environment, working directory, arguments and
standard streams, forwards every signal torchrun sends, and ends with the
worker's exit status. Anything that stops a warm start before the fork (no
warm process can be started, a different interpreter or environment, not
Linux, ``ELASTIC_FT_WARM_START=0``) starts the worker cold, as before.

Protocol and places: :mod:`~elastic_ft.warm.protocol`. The warm process never
runs torch code itself (it only imports), so a fork of it is as safe as the
fork torch's own DataLoader workers are made with.
"""
