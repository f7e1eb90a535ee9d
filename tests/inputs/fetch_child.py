"""A worker resolving one input, for the concurrency test: ``python fetch_child.py CACHE URI READY_FILE GO_FILE``.

Creates READY_FILE once imported and set up, then waits until GO_FILE exists (so several children start their resolve together),
resolves URI into CACHE, and prints JSON: the files it downloaded and the
sha256 of the file it then reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.inputs.resolve import InputSource
from elastic_ft.inputs.settings import InputsConfig
from tests.waiting import wait_until


def main(cache: str, uri: str, ready: str, go: str) -> None:
    source = InputSource(InputsConfig(cache_dir=cache), S3Options(max_attempts=3, backoff_initial=0.01))
    open(ready, "w").close()
    # The parent creates it once every child is waiting.
    wait_until(lambda: os.path.exists(go), timeout=60, what=f"the go file {go}", interval=0.005)
    with source:
        path = source.file(uri, "data.files[0]")
        fetched = source.fetched[uri]
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    print(json.dumps({"fetched": fetched, "sha256": digest}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
