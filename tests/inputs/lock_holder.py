"""Another worker holding an input cache entry's lock: ``python lock_holder.py LOCK_FILE HELD_FILE RELEASE_FILE``.

Takes the lock as the cache does (elastic_ft.inputs.cache.entry_lock), creates HELD_FILE, and keeps the
lock until RELEASE_FILE exists (at most 120 s).
"""

from __future__ import annotations

import os
import sys
import time

from elastic_ft.inputs.cache import entry_lock


def main(lock: str, held: str, release: str) -> None:
    with entry_lock(lock, timeout_s=30):
        open(held, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)


if __name__ == "__main__":
    main(*sys.argv[1:4])
