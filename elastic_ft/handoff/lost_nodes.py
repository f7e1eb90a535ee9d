"""Why a round follows a lost node: the agent puts it in the environment its next workers inherit.

The agent (:mod:`elastic_ft.rendezvous.handler`) knows which node of the last
round is gone and why; the workers it starts next (:mod:`elastic_ft.train.peer_loss`)
know from which step and at which world the job resumes, and join the two in
one line per node.
"""

from __future__ import annotations

LOST_NODES_ENV = "ELASTIC_FT_LOST_NODES"
"""Set by the agent for the workers of a round that follows a lost node: which node(s) and why."""
