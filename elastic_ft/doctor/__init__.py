"""``elastic-ft doctor``: checks for the classic multi-node failures, one line each.

One module per thing checked; in each, the decision is a pure function of what
was found (tested without the network) and a thin wrapper does the I/O. The
checks a torchrun agent also runs at start-up live below the rendezvous, in
:mod:`elastic_ft.preflight` (the result type, the network, the versions);
these are the rest:

- ``rendezvous``: etcd answers and speaks v3.
- ``storage``: the checkpoint store is writable and refuses a second conditional
  create; the clock against the S3 server's ``Date``.
- ``ec2``: the instance metadata service (instance type, spot notice) or its absence.
- ``command``: the subcommand's arguments and the order the checks run in.

Nothing heavy is imported at module level: ``elastic-ft --help`` must stay fast.
"""
