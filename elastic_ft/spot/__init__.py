"""Spot preemption: notices from the instance metadata service and SIGTERM, and the response to them.

:mod:`~elastic_ft.spot.imds` talks to IMDSv2, :mod:`~elastic_ft.spot.watcher`
turns what it says (and SIGTERM) into a notice the training loop reads as a
flag, and :mod:`~elastic_ft.spot.policy` decides, as a pure function, what a
notice calls for at a step boundary. How a node's workers tell their torchrun
agent that the node leaves is :mod:`elastic_ft.handoff.leave_marker`.
"""
