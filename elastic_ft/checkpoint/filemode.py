"""File modes: what we write gets the permissions the user's umask asks for.

Temporary files (``tempfile.mkstemp``, and libraries that save through one,
such as safetensors' ``save_file``) are created with mode 0600 whatever the
umask. Renamed into place, they would leave checkpoint blobs, manifests and
exported weights readable by their owner only, which breaks a filesystem
shared with other users or services. Every file we create ends up with
``0666 & ~umask`` instead, as ``open(path, "w")`` would have given it.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import threading

_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without changing it where the system allows.

    Linux reports it in ``/proc/self/status``; elsewhere it is read by setting
    and restoring it, under a lock (two threads doing that at once could leave 0).
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def default_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file now: ``0666 & ~umask``."""
    return 0o666 & ~current_umask()


@dataclasses.dataclass(frozen=True)
class FileTree:
    """The regular files under a directory at one moment: path -> (inode, mtime in ns, size).

    Take one before writing into a directory with libraries we do not control
    (``save_pretrained``), then :meth:`apply_umask_to_written` finds what they
    created or rewrote by comparing, and gives it :func:`default_file_mode`
    (timestamps are coarse, so the size is compared too; a file rewritten in
    place with the same size within one tick keeps its mode, which ``open``
    kept anyway).
    Files that were there and were not touched keep their mode: they are the user's.
    """

    directory: str
    files: dict[str, tuple[int, int, int]]

    @classmethod
    def of(cls, directory: str) -> FileTree:
        files: dict[str, tuple[int, int, int]] = {}
        for dirpath, _dirs, names in os.walk(directory):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue  # removed while we looked
                if stat.S_ISREG(st.st_mode):
                    files[path] = (st.st_ino, st.st_mtime_ns, st.st_size)
        return cls(directory, files)

    def apply_umask_to_written(self) -> list[str]:
        """Chmod every file created or rewritten since this snapshot; returns their paths."""
        mode = default_file_mode()
        written = [p for p, ident in FileTree.of(self.directory).files.items() if self.files.get(p) != ident]
        for path in written:
            os.chmod(path, mode)
        return written


__all__ = ["FileTree", "current_umask", "default_file_mode"]
