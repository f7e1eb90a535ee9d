"""A file's stat stamp: whether a file verified once is still, byte for byte, the file that was verified.

A stamp is the file's size, mtime, ctime, inode and device, taken before the
file was hashed and recorded beside the digest. A later start that finds the
same stamp trusts the recorded digest instead of reading the file again: a
few stats instead of a pass over gigabytes. ctime is the kernel's: no process
can set it (``utime`` sets mtime and moves ctime to now), so a file written in
place and its mtime put back still shows a new stamp; a file replaced by
another (rename, copy) has another inode. What it cannot see: a write by
someone who also sets the clock back, or raw writes to the block device.

Used by the token store's node copy (:mod:`elastic_ft.train.token_files`) and
the input cache (:mod:`elastic_ft.inputs.cache`).
"""

from __future__ import annotations

import os


def stat_stamp(st: os.stat_result) -> list[int]:
    """``[size, mtime_ns, ctime_ns, inode, device]`` of a stat result (a list: it is compared with JSON-loaded
    ones)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_stamp(path: str) -> list[int]:
    """:func:`stat_stamp` of the file at ``path``."""
    return stat_stamp(os.stat(path))


__all__ = ["file_stamp", "stat_stamp"]
