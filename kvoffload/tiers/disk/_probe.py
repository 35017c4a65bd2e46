"""The scheduler side's view of a disk tier: which chunk files exist, asked of the directory.

Apart from :mod:`kvoffload.tiers.disk` so the scheduler process imports neither
the index (SQLite) nor the data plane to plan a load.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from kvoffload.tiers._validation import namespace_fingerprint, valid_key
from kvoffload.tiers.disk._files import chunk_name, is_regular

__all__ = ["DiskProbe"]


class DiskProbe:
    """Asks whether chunk files exist in a disk tier another object (or process) owns.

    The scheduler side of a connector plans loads but never touches bytes;
    the worker's :class:`DiskTier` owns the directory. A probe answers from
    the directory itself, so it sees what any process on the path stored or
    evicted, with no message between them. Like ``Tier.contains`` it is a
    hint: a file may vanish or prove corrupt before the load, which then fails
    and is recomputed. It opens the namespace directory (once it exists)
    without following a link, and counts only regular files.
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike[str], namespace: bytes) -> None:
        self._root = Path(path)
        self._name = namespace_fingerprint(namespace).hex()
        self._fd: int | None = None

    def _directory(self) -> int | None:
        if self._fd is None:
            with contextlib.suppress(OSError):
                self._fd = os.open(
                    self._root / self._name,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                )
        return self._fd

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One ``lstat`` per key, relative to the directory; no index, no lock, nothing created."""
        fd = self._directory()
        if fd is None:
            return [False] * len(keys)
        return [valid_key(key) and is_regular(fd, chunk_name(key)) for key in keys]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
