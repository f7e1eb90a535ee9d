"""The node's fast checks: run by every torchrun agent at start-up (warnings only) and by ``elastic-ft doctor``.

Below the rendezvous (whose handler runs :func:`~elastic_ft.preflight.startup.report_at_startup`)
and the doctor (which runs these and more); imports nothing else of the package.

- ``report``: :class:`~elastic_ft.preflight.report.Result` (PASS/FAIL/WARN/SKIP, name, found, fix) and its line.
- ``network``: the hostname's address, the socket interface variables, the ports.
- ``versions``: every node's versions, posted in etcd and compared.
- ``startup``: the fast subset a multi-node job runs at start-up, warning only.

Nothing heavy is imported at module level: ``elastic-ft --help`` must stay fast.
"""
