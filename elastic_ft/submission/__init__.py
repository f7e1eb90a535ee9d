"""What the torchx component (:mod:`elastic_ft.components`) and the ``aws_batch`` scheduler check and build at submission.

Modules: ``arguments`` (the component's argument checks, one line each naming
the flag), ``batch_fit`` (the largest world against the spec's batch),
``bash_line`` (the one ``bash -c`` line every node runs: quoting, and the
environment names bash itself reads), ``node_resources`` (GPUs, EFA
interfaces, processes per node, the NCCL/EFA environment) and ``app_metadata``
(the AppDef metadata keys the scheduler reads back). Everything here is pure
but ``batch_fit``, which reads the job spec file once.
"""
