"""What a torchrun agent and its workers tell each other: the bottom layer, imported by both sides.

The agent's side lives in :mod:`elastic_ft.rendezvous` and the workers' side in
:mod:`elastic_ft.train`; neither may import the other (see the layers in
DESIGN.md), so what they exchange is defined here once:

- :mod:`.leave_marker`: the file a node's workers write when the node leaves
  on a spot notice (or stays while others leave), the note the agent leaves
  them when a member of the round is lost, and the reclaim exit status.
- :mod:`.lost_nodes`: the environment variable in which the agent tells the
  workers of a new round which node(s) of the last one are gone, and why.

Nothing here imports torch or another part of the package.
"""
