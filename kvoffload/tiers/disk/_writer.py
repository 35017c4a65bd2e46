"""How a chunk gets into a writable ``disk_path``: reserve, write, commit, each making room.

Three steps write, and each can meet a full file system: the reservation
(the index records it), the data file, and the commit (the index records
the chunk while the file is renamed into place). Each meets ``ENOSPC``,
``EDQUOT`` and SQLite's "database or disk is full" (:class:`NoSpace`) the
same way: evict the oldest chunks for what the file system lacks (and room
for the index's log), count a ``full_retries``, and try that step once more.
What still fails is a failed store, with nothing left behind.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
from dataclasses import dataclass, field
from functools import partial

from kvoffload.errors import TierError
from kvoffload.tiers._record import file_bytes
from kvoffload.tiers.base import ChunkBuffer
from kvoffload.tiers.disk._chunk_io import ChunkFileIO
from kvoffload.tiers.disk._files import NamespaceDir, chunk_name, os_errors
from kvoffload.tiers.disk._index import Full, NoSpace, Remover, SharedIndex
from kvoffload.tiers.disk._owners import OwnerLock
from kvoffload.tiers.disk._repair import reap_dead_writers
from kvoffload.tiers.stats import TierCounters

__all__ = ["ChunkWriter", "count_evictions"]

_FULL = (errno.ENOSPC, errno.EDQUOT)
#: Bytes a full disk must also free for the index's log to record the store.
_INDEX_ROOM = 1 << 20


def count_evictions(counters: TierCounters, evicted: tuple[int, int]) -> None:
    counters.add(evictions=evicted[0], evicted_bytes=evicted[1])


@dataclass(slots=True)
class ChunkWriter:
    """The store path of one writable disk tier; the tier checks the key and buffer first."""

    directory: NamespaceDir
    index: SharedIndex
    owner: OwnerLock
    io: ChunkFileIO
    counters: TierCounters
    namespace: bytes
    capacity: int
    remove: Remover
    _temps: itertools.count[int] = field(default_factory=itertools.count)

    def store(self, key: bytes, payload: ChunkBuffer) -> bool:
        """Reserve room, write a temp file, rename it into place and record it; ``False``
        (nothing written) for a chunk whose file is already there.

        A key names its bytes, so such a file holds them: another process stored
        it, or the engine computed a block it could not take as a hit (vLLM
        computes at least a prompt's last token, and stores that chunk again).
        Writing it again would first reserve room, evicting another chunk for
        nothing; it is a use, so its recency is refreshed.
        """
        if self.directory.is_regular(chunk_name(key)):
            self.index.touch(self.namespace, key)
            return False
        need = file_bytes(payload.nbytes)
        temp = self.owner.temp_name(key.hex(), next(self._temps))
        self._reserve(temp, need)
        stored = False
        try:
            with os_errors(f"disk store of {key.hex()}"):
                inode = self._write_temp(temp, key, payload, need)
                self._commit(key, temp, need, inode)
            stored = True
        finally:
            if not stored:
                self.directory.remove(temp)
                # The store's own error is the one to report; a reservation the index
                # could not drop now is released when this process exits.
                with contextlib.suppress(TierError):
                    self.index.release(self.namespace, temp)
        return True

    def _reserve(self, temp: str, need: int) -> None:
        """Hold ``need`` bytes of the shared budget. If stores in flight hold too much, first
        release what crashed processes reserved; if the index's disk is full, make room;
        then try once more."""
        write = (self.namespace, temp, self.owner.token)
        for attempt in (1, 2):
            try:
                count_evictions(
                    self.counters, self.index.reserve(write, need, self.capacity, self.remove)
                )
                return
            except Full as exc:
                if attempt == 2 or not exc.totals.reserved:
                    raise
                token = self.owner.token
                if not reap_dead_writers(self.directory, self.index, token, self.counters):
                    raise
            except NoSpace:
                if attempt == 2 or not self._make_room(need, errno.ENOSPC):
                    raise

    def _write_temp(self, temp: str, key: bytes, payload: ChunkBuffer, need: int) -> int:
        """Write the chunk to ``temp``; on ENOSPC/EDQUOT make room and retry once. Its inode."""
        for attempt in (1, 2):
            try:
                fd = self.directory.create(temp, self.io.open_flags)
                try:
                    self.io.write(fd, (self.namespace, key), payload)
                    return os.fstat(fd).st_ino
                finally:
                    os.close(fd)
            except OSError as exc:
                self.directory.remove(temp)
                if attempt == 2 or exc.errno not in _FULL or not self._make_room(need, exc.errno):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _commit(self, key: bytes, temp: str, need: int, inode: int) -> None:
        """Rename the temp file into place and record it, in one index transaction; if the
        index's disk is full, make room and try once more. If it fails after the rename,
        the renamed file goes too (it is not counted): only that file, by its inode, never
        one another store put there."""
        final = chunk_name(key)
        place = partial(self._place, temp, final, inode)
        try:
            for attempt in (1, 2):
                try:
                    self.index.commit(self.namespace, key, temp, need, place)
                    return
                except NoSpace:
                    if attempt == 2 or not self._make_room(need, errno.ENOSPC):
                        raise
        except TierError:
            self.directory.remove(final, inode)
            raise

    def _place(self, temp: str, final: str, inode: int) -> None:
        """Rename ``temp`` to ``final``, unless a commit that failed after its rename left
        the file there (run inside the transaction: no other store renames meanwhile)."""
        placed = self.directory.lstat(final)
        if placed is not None and placed.st_ino == inode and self.directory.lstat(temp) is None:
            return
        self.directory.rename(temp, final)

    def _make_room(self, need: int, error: int) -> bool:
        """Evict the oldest chunks for what the file system lacks (and room for the index to
        record the store), counting a retry; ``False`` if they cannot free that much (the
        store then fails without emptying the tier for nothing)."""
        need += _INDEX_ROOM
        fs = os.fstatvfs(self.directory.fd)
        lacking = need if error == errno.EDQUOT else need - fs.f_bavail * fs.f_frsize
        evicted = self.index.evict(max(lacking, 1), self.remove)
        if evicted is None:
            return False
        count_evictions(self.counters, evicted)
        self.counters.add(full_retries=1)
        return True
