"""Running ``elastic_ft.train`` on AWS Batch Spot: ``torchx run -s aws_batch elastic_ft.train --nnodes 2:8 ...``.

AWS Batch does not run multi-node parallel jobs on Spot, and torchx's
``aws_batch`` scheduler submits nothing else. :mod:`~elastic_ft.aws_batch.request`
plans an array job of single-node containers instead (pure),
:mod:`~elastic_ft.aws_batch.retry` its retry rules and how AWS evaluates them,
:mod:`~elastic_ft.aws_batch.state` reads job descriptions back, and
:mod:`~elastic_ft.aws_batch.scheduler` is the torchx scheduler that does the I/O.
:mod:`~elastic_ft.runevents.node_identity` names the node a worker runs on.
"""
