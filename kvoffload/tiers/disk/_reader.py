"""How a chunk comes out of a ``disk_path``: a regular file, verified, its use recorded.

The load path of a writable tier and of a read-only one alike; what differs is
the books. A writable tier records each load's use in the shared index, forgets
a chunk whose file has vanished (another process evicted or discarded it), and
drops a chunk that fails verification (unless a store replaced it meanwhile). A
read-only tier keeps no books: a vanished file is a miss, a corrupt one stays and
fails each load (counted as ``corrupt``). The store path is
:mod:`~kvoffload.tiers.disk._writer`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from kvoffload.errors import CorruptChunkError, TierError
from kvoffload.tiers.base import ChunkBuffer
from kvoffload.tiers.disk._chunk_io import ChunkFileIO
from kvoffload.tiers.disk._files import NamespaceDir, NotRegular, Removal, chunk_name, os_errors
from kvoffload.tiers.disk._index import SharedIndex
from kvoffload.tiers.stats import TierCounters

__all__ = ["ChunkReader"]


@dataclass(slots=True)
class ChunkReader:
    """The load path of one disk tier; ``index`` is ``None`` for a read-only one. The tier
    checks the key and the buffer first."""

    directory: NamespaceDir
    index: SharedIndex | None
    io: ChunkFileIO
    counters: TierCounters
    namespace: bytes

    def load(self, key: bytes, buf: ChunkBuffer) -> bool:
        """Load ``key`` into ``buf``; ``False`` if its file is missing or not a regular file."""
        try:
            with os_errors(f"disk load of {key.hex()}"):
                fd = self.directory.open_regular(chunk_name(key), self.io.open_flags)
        except NotRegular:
            self.counters.add(not_regular_files=1)
            return False
        if fd is None:
            self._vanished(key)
            return False
        try:
            inode = os.fstat(fd).st_ino
            with os_errors(f"disk load of {key.hex()}"):
                self.io.read_into(fd, (self.namespace, key), buf)
        except CorruptChunkError:
            self._drop(key, inode)
            raise
        finally:
            os.close(fd)
        if self.index is not None:  # read-only: last use is not recorded
            self.index.touch(self.namespace, key)
        return True

    def _vanished(self, key: bytes) -> None:
        """A file that is gone no longer holds budget (unless a store just put it back)."""
        if self.index is not None and self.index.holds(self.namespace, key):
            name = chunk_name(key)
            self.index.forget(self.namespace, key, lambda: self.directory.lstat(name) is None)

    def _drop(self, key: bytes, inode: int) -> None:
        """Drop a chunk that failed verification, unless a store replaced it meanwhile."""
        if self.index is None:
            return  # read-only: it stays, and fails each load (counted as corrupt)
        with contextlib.suppress(TierError):
            self.index.forget(
                self.namespace,
                key,
                lambda: self.directory.remove(chunk_name(key), inode) is not Removal.REPLACED,
            )
