"""Seeing a run: its events drawn as a figure, or streamed to TensorBoard.

- ``series``: a run's events turned into what is drawn (pure: no matplotlib).
- ``figure``: the figure of ``elastic-ft plot`` (matplotlib, the ``plot`` extra).
- ``tensorboard``: an :class:`~elastic_ft.runevents.events.EventLog` sink writing step
  metrics and run events with torch's ``SummaryWriter`` (the ``tensorboard`` extra).

Nothing heavy is imported at module level: the optional packages are imported
when used, and a missing one is one line naming the pip extra.
"""
