"""A ``disk_path`` this process may read but not write: served read-only.

A cache filled elsewhere and shipped read-only (a baked image layer, a shared
volume mounted read-only, a directory of another user) is still worth
serving: a chunk is a verified file, and finding and loading one writes
nothing. So a disk tier on a directory it cannot write starts read-only
when the directory holds chunks of its model: lookups and loads as usual,
stores skipped and counted (``read_only_skips``), one warning at start that
says why. One that holds none has nothing to offer: a ``ConfigError``.

The shared index is not opened at all. Loads never needed it, and what it
is for (the budget, the eviction order, repairs, last-use times) all
writes. Opening it read-only would not even give fresh figures: SQLite
reads a WAL index only through its ``-shm`` file, which a read-only
directory may lack, and ``immutable=1`` ignores the log. So the tier's
``chunks`` and ``used_bytes`` are those its namespace directory held at
start, and nothing is repaired, cleaned up or evicted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
from pathlib import Path
from typing import NamedTuple

from kvoffload.errors import ConfigError
from kvoffload.tiers.disk._files import Found, NamespaceDir, ReadOnly, parse_chunk_name

__all__ = ["Served", "namespace_dir", "nothing_to_serve", "read_only_cause", "served"]

#: ``FS_IOC_GETFLAGS`` and its ``FS_IMMUTABLE_FL`` bit (``linux/fs.h``): what ``lsattr`` reads.
_GET_FLAGS, _IMMUTABLE = 0x80086601, 0x10


class Served(NamedTuple):
    """What a read-only namespace directory held at start: chunk files and their bytes."""

    chunks: int
    used_bytes: int


def read_only_cause(fd: int) -> str | None:
    """Why this process may not create files in directory ``fd``; ``None`` if it may."""
    if os.access(".", os.W_OK, dir_fd=fd, effective_ids=True):
        return None
    if os.fstatvfs(fd).f_flag & os.ST_RDONLY:
        return "it is on a read-only mount"
    flags = 0
    with contextlib.suppress(OSError):  # file systems without attributes (tmpfs) have none
        flags = struct.unpack_from("i", fcntl.ioctl(fd, _GET_FLAGS, bytes(8)))[0]
    if flags & _IMMUTABLE:
        return "it is immutable (chattr +i)"
    st = os.fstat(fd)
    return (
        f"user {os.geteuid()} may not write it (mode {stat.S_IMODE(st.st_mode):04o}, "
        f"owner {st.st_uid})"
    )


def nothing_to_serve(root: str, cause: str) -> ConfigError:
    return ConfigError(
        f"disk_path {root!r} is read-only ({cause}) and holds no chunks of this model to "
        "serve; make it writable, or point disk_path at a writable directory"
    )


def served(directory: NamespaceDir) -> Served:
    """The chunk files of a read-only namespace directory (regular files only)."""
    found = [
        entry
        for entry in directory.scan()
        if isinstance(entry, Found) and parse_chunk_name(entry.name) is not None
    ]
    return Served(len(found), sum(entry.charged for entry in found))


def namespace_dir(root: Path, name: str) -> NamespaceDir:
    """Open (or create) the namespace directory; a read-only root without it serves nothing."""
    try:
        return NamespaceDir(root, name)
    except ReadOnly as exc:
        raise nothing_to_serve(str(root), _refused(root, exc)) from exc


def _refused(root: Path, exc: OSError) -> str:
    """Why a directory could not be created under ``root``, as :func:`read_only_cause` says."""
    with contextlib.suppress(OSError):
        fd = os.open(root if root.is_dir() else root.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            cause = read_only_cause(fd)
        finally:
            os.close(fd)
        if cause is not None:
            return cause
    return str(exc.strerror)
