"""``elastic-ft doctor``: checks for the classic multi-node failures, one line each.

One module per thing checked; in each, the decision is a pure function of what
was found (tested without the network) and a thin wrapper does the I/O:

- ``report``: :class:`Result` (PASS/FAIL/WARN/SKIP, name, found, fix) and its line.
- ``network``: the hostname's address, the socket interface variables, the ports.
- ``rendezvous``: etcd answers and speaks v3; every node's versions, posted and compared.
- ``storage``: the checkpoint store is writable and refuses a second conditional
  create; the clock against the S3 server's ``Date``.
- ``ec2``: the instance metadata service (instance type, spot notice) or its absence.
- ``command``: the subcommand's arguments and the order the checks run in.
- ``startup``: the fast subset a multi-node job runs at start-up, warning only.

Nothing heavy is imported at module level: ``elastic-ft --help`` must stay fast.
"""
