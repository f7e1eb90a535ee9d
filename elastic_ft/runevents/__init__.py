"""A run's events kept in its checkpoint store, so that no node's loss takes part of its history.

The leader's events go to its local ``events.jsonl`` as before (:mod:`elastic_ft.runevents.events`) and are
also shipped, a batch at a time, to the run's location in the checkpoint store, under ``events/``
(:mod:`~elastic_ft.runevents.layout` names the keys). A batch is shipped before the manifest of each
checkpoint is committed, so the events of every committed step are in the store whatever node is
lost afterwards; and at the run's end (best effort on any other exit).

- :mod:`~elastic_ft.runevents.layout`: the keys, and the attempt claim (unique attempt numbers
  across machines);
- :mod:`~elastic_ft.runevents.shipper`: the leader's side, fed by the :class:`~elastic_ft.runevents.events.EventLog`;
- :mod:`~elastic_ft.runevents.merge`: the pure rule that merges batches into one history;
- :mod:`~elastic_ft.runevents.schema`: the fields each kind of event needs, checked for every reader
  (a malformed event is skipped and counted, never a traceback);
- :mod:`~elastic_ft.runevents.load`: :func:`load_run_events` for the commands (``events``,
  ``status``, ``goodput``, ``plot``);
- :mod:`~elastic_ft.runevents.status`: a run at a glance (``elastic-ft status``).
"""
