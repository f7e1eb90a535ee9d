"""Inputs every node can reach: ``s3://`` data files and model directories, fetched once per node.

A spec's ``data.files`` entries may be ``s3://bucket/key`` and its
``model.name_or_path`` / ``model.tokenizer`` ``s3://bucket/prefix/``; each
node downloads them into a node-local cache before loading, so a Batch job's
image carries neither data nor weights.

Modules: ``settings`` (the spec's ``inputs`` section), ``uri`` (the URIs and
the keys they may name: pure), ``plan`` (whether a cached copy may be reused:
pure), ``remote`` (HEAD, LIST, and GETs into a file: the checkpoint
store's parallel ranged reads, client and retry policy), ``cache`` (the node-local cache: lock, records,
atomic renames) and ``resolve`` (a spec's data and model sections with their
remote URIs replaced by cached paths).

Nothing is imported here: the job spec imports :mod:`.settings` and
:mod:`.uri`, and :mod:`.resolve` imports the spec's sections.
"""
