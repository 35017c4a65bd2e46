"""The disk tier: one verified file per chunk, every process on a ``disk_path`` within one budget.

Layout: ``<disk_path>/<namespace fingerprint hex>/<key hex>.kv``, directories
created 0700 and files 0600, names built from hex only; beside them,
``<disk_path>/kvoffload-index.sqlite3``, the index every process on the path
shares. The file format and checksum: :mod:`kvoffload.tiers._record`.

Why it is built this way:

* **Shared by processes.** Data-parallel replicas, several servers of one
  model and the tensor-parallel ranks of one server may all use one
  ``disk_path``. A chunk is a file, so one a process stored is a hit for the
  others (:class:`DiskProbe` and :meth:`DiskTier.contains_many` ask the
  directory). Together they stay within ``disk_bytes_to_use``, in one LRU
  order, through a small SQLite index (:mod:`~kvoffload.tiers.disk._index`:
  why that, and its cost). No process deletes another's write in flight, and
  a crashed one's leftovers are cleaned by whoever starts next or runs short
  of room (:mod:`~kvoffload.tiers.disk._files`, :mod:`~kvoffload.tiers.disk._repair`).
* **Atomic stores.** A temp file is renamed over the chunk's name inside the
  index transaction that records it: a crash (even SIGKILL) leaves the old
  chunk, the new one, or a temp file cleaned later. Files are not fsynced: a
  power cut may lose or tear chunks; the checksum makes a torn one a miss.
* **Nothing outside ``disk_path``, nothing that blocks**: regular files only,
  opened relative to the namespace directory (``not_regular_files`` counts
  what is skipped); see :mod:`~kvoffload.tiers.disk._files`.
* **A full disk makes room.** ``ENOSPC``, ``EDQUOT`` or a full index evicts
  the oldest chunks (what the file system lacks) and retries once
  (``full_retries``); what still fails is a failed store.
* **Degrades, never crashes.** An ``OSError`` or SQLite error fails that one
  call with ``TierError`` (counted; translated in :func:`_os_errors` and the
  index); a checksum mismatch drops the chunk (``CorruptChunkError``); a
  vanished file is a miss; an index held by a stuck process fails calls
  after a bounded wait instead of stalling the engine.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

from kvoffload.errors import ConfigError, CorruptChunkError, TierError
from kvoffload.tiers._record import MAX_KEY_BYTES, file_bytes
from kvoffload.tiers._validation import (
    check_budget,
    checked_buffer,
    namespace_fingerprint,
    valid_key,
)
from kvoffload.tiers.base import ChunkBuffer, Tier
from kvoffload.tiers.disk._chunk_io import ChunkFileIO
from kvoffload.tiers.disk._direct_io import probe_direct_io
from kvoffload.tiers.disk._files import (
    NamespaceDir,
    NotRegular,
    OwnerLock,
    Removal,
    chunk_name,
)
from kvoffload.tiers.disk._index import Full, NoSpace, SharedIndex
from kvoffload.tiers.disk._probe import DiskProbe
from kvoffload.tiers.disk._repair import audit, reap_dead_writers, reconcile
from kvoffload.tiers.stats import TierCounters, TierStats

__all__ = ["DiskProbe", "DiskTier"]  # DiskProbe lives apart (no SQLite on the scheduler side)

#: The disk tier's own counters, beside the shared ones of :class:`TierStats`.
COUNTERS = ("temp_files_cleaned", "unlink_failures", "not_regular_files", "full_retries")
_FULL = (errno.ENOSPC, errno.EDQUOT)
#: Bytes a full disk must also free for the index's log to record the store.
_INDEX_ROOM = 1 << 20


class _Closed(TierError):
    """A call after ``close()``."""


@contextlib.contextmanager
def _os_errors(what: str, error: type[TierError | ConfigError] = TierError) -> Iterator[None]:
    """The disk tier's one translation of ``OSError``: ``TierError`` for a call (that call
    fails, the tier serves on), ``ConfigError`` at start-up (the directory is unusable)."""
    try:
        yield
    except OSError as exc:
        raise error(f"{what} failed: {exc}") from exc


class DiskTier(Tier):
    """Chunks as checksummed files under ``path``, all users of ``path`` within ``bytes_to_use``.

    ``namespace`` is the layout fingerprint (``kvoffload.keys.namespace_of``).
    ``direct`` forces O_DIRECT on (``ConfigError`` if refused) or off; ``None``
    probes the directory once. Each store and load is one vectored syscall in
    the calling thread: the engine's thread pool supplies the parallelism.
    ``stats()`` reports this process's events and the whole path's bytes and
    chunks (what the budget bounds).
    """

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        bytes_to_use: int,
        namespace: bytes,
        *,
        direct: bool | None = None,
    ) -> None:
        if not isinstance(path, str | os.PathLike) or not str(path):
            raise ConfigError(f"disk_path must be a directory path, got {path!r}")
        self._capacity = check_budget(bytes_to_use)
        self._namespace = namespace_fingerprint(namespace)
        self._counters = TierCounters(self.name, COUNTERS)
        self._dir = NamespaceDir(Path(path), self._namespace.hex())
        self._lock = threading.Lock()
        self._calls = 0
        self._closed: bool = False
        self._temps = itertools.count()
        try:
            with _os_errors(f"opening disk_path {str(path)!r}", ConfigError):
                self._owner = OwnerLock(self._dir)
                probed = probe_direct_io(self._dir.fd, self._owner.temp_name("probe", 0))
            if direct and not probed:
                raise ConfigError(f"disk_path {str(path)!r} refuses O_DIRECT; leave direct unset")
            self._io = ChunkFileIO(probed if direct is None else direct)
            self._index = SharedIndex(Path(path))
            self._recover()
        except BaseException:
            if hasattr(self, "_owner"):
                self._owner.release()
            self._dir.close()
            raise
        self._last = self._index.totals()

    def _recover(self) -> None:
        """Clean up after crashed processes and index what the directory holds (at start)."""
        try:
            with _os_errors(f"reading {self._dir.path}", ConfigError):
                token = self._owner.token
                reap_dead_writers(self._dir, self._index, token, self._counters)
                reconcile(self._dir, self._index, self._namespace, token, self._counters)
            self._count_evictions(self._index.fit(self._capacity, self._remove))
            self._index.serve()
        except BaseException:
            self._index.close()
            raise

    @property
    def directory(self) -> Path:
        """The namespace directory holding this tier's files."""
        return self._dir.path

    @property
    def direct_io(self) -> bool:
        """Whether chunks move with O_DIRECT (else buffered I/O)."""
        return self._io.direct

    # -- the Tier contract --------------------------------------------------

    def put(self, key: bytes, data: ChunkBuffer) -> None:
        """Store ``data`` atomically under ``key``, evicting LRU chunks to stay in budget.

        Raises ``TierError`` (counted) for a bad key, a chunk bigger than the
        budget, a budget held entirely by stores in flight, or an ``OSError``.
        """
        self._counters.store(lambda: self._store(key, data))

    def get_into(self, key: bytes, out: ChunkBuffer) -> bool:
        """Fill ``out`` with the verified chunk; ``False`` if not held (or not a regular file).

        A corrupt chunk is dropped and raises ``CorruptChunkError``; a size
        mismatch raises ``TierError`` and leaves the chunk in place.
        """
        return self._counters.load(out.nbytes, lambda: self._load(key, out))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each chunk's file is there, whoever stored it (one ``lstat`` per key);
        all ``False`` once the tier is closed."""
        try:
            with self._call():
                return [valid_key(k) and self._dir.is_regular(chunk_name(k)) for k in keys]
        except _Closed:
            return [False] * len(keys)

    def discard(self, key: bytes) -> None:
        """Delete ``key``'s file; not an eviction (the caller asked)."""

        def remove() -> bool:
            self._remove(self._namespace, key)
            return True

        if valid_key(key):
            with self._call():
                self._index.forget(self._namespace, key, remove)

    def stats(self) -> TierStats:
        """Counters of this process; used/capacity bytes and chunks of the whole path."""
        with contextlib.suppress(TierError):  # an index busy for long: the last figures
            self._last = self._index.totals()
        totals = self._last
        return self._counters.snapshot(
            used_bytes=totals.used,
            chunks=totals.chunks,
            capacity_bytes=self._capacity,
            gauges={"reserved_bytes": totals.reserved, "direct_io": int(self._io.direct)},
        )

    def check_integrity(self) -> None:
        """Compare the index's totals with its rows, and this namespace's rows with its
        directory (read in one index transaction); raise with numbers."""
        with self._call():
            audit(self._dir, self._index, self._namespace, self._capacity)

    def close(self) -> None:
        """Refuse further calls; files stay for a warm restart. Calls in flight finish
        first, then this process's claim on its temp files is released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._calls == 0
        if idle:
            self._release()

    # -- internals ----------------------------------------------------------

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        with self._lock:
            closed = self._closed  # (a local: mypy would narrow the attribute for good)
            if closed:
                raise _Closed("disk tier is closed")
            self._calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                last = self._closed and self._calls == 0
            if last:
                self._release()

    def _release(self) -> None:
        self._index.close()
        self._owner.release()
        self._dir.close()

    def _store(self, key: bytes, data: ChunkBuffer) -> int:
        """Reserve room, write a temp file, rename it into place; the payload bytes stored."""
        with self._call():
            payload = checked_buffer("data", data)
            if not valid_key(key):
                raise TierError(
                    f"DiskTier: key must be 1 to {MAX_KEY_BYTES} bytes, got {key!r:.80}"
                )
            need = file_bytes(payload.nbytes)
            if need > self._capacity:
                raise TierError(
                    f"chunk needs {need} B on disk, more than disk_bytes_to_use {self._capacity} B"
                )
            temp = self._owner.temp_name(key.hex(), next(self._temps))
            self._reserve(temp, need)
            stored = False
            try:
                with _os_errors(f"disk store of {key.hex()}"):
                    inode = self._write_temp(temp, key, payload, need)
                    self._commit(key, temp, need, inode)
                stored = True
            finally:
                if not stored:
                    self._dir.remove(temp)
                    # The store's own error is the one to report; a reservation the index
                    # could not drop now is released when this process exits.
                    with contextlib.suppress(TierError):
                        self._index.release(self._namespace, temp)
            return payload.nbytes

    def _reserve(self, temp: str, need: int) -> None:
        """Hold ``need`` bytes of the shared budget. If stores in flight hold too much, first
        release what crashed processes reserved; if the index's disk is full, make room;
        then try once more."""
        write = (self._namespace, temp, self._owner.token)
        for attempt in (1, 2):
            try:
                evicted = self._index.reserve(write, need, self._capacity, self._remove)
                self._count_evictions(evicted)
                return
            except Full as exc:
                if attempt == 2 or not exc.totals.reserved:
                    raise
                if not reap_dead_writers(self._dir, self._index, self._owner.token, self._counters):
                    raise
            except NoSpace:
                if attempt == 2 or not self._make_room(need, errno.ENOSPC):
                    raise
                self._counters.add(full_retries=1)

    def _write_temp(self, temp: str, key: bytes, payload: ChunkBuffer, need: int) -> int:
        """Write the chunk to ``temp``; on ENOSPC/EDQUOT make room and retry once. Its inode."""
        for attempt in (1, 2):
            try:
                fd = self._dir.create(temp, self._io.open_flags)
                try:
                    self._io.write(fd, (self._namespace, key), payload)
                    return os.fstat(fd).st_ino
                finally:
                    os.close(fd)
            except OSError as exc:
                self._dir.remove(temp)
                if attempt == 2 or exc.errno not in _FULL or not self._make_room(need, exc.errno):
                    raise
                self._counters.add(full_retries=1)
        raise AssertionError("unreachable")  # pragma: no cover

    def _make_room(self, need: int, error: int) -> bool:
        """Evict the oldest chunks for what the file system lacks (and room for the index to
        record the store); ``False`` if they cannot free that much (the store then fails
        without emptying the tier for nothing)."""
        need += _INDEX_ROOM
        fs = os.fstatvfs(self._dir.fd)
        lacking = need if error == errno.EDQUOT else need - fs.f_bavail * fs.f_frsize
        evicted = self._index.evict(max(lacking, 1), self._remove)
        if evicted is None:
            return False
        self._count_evictions(evicted)
        return True

    def _commit(self, key: bytes, temp: str, need: int, inode: int) -> None:
        """Rename the temp file into place and record it, in one index transaction. If the
        transaction fails after the rename, the renamed file goes too (it is not counted):
        only that file, by its inode, never one another store put there."""
        final = chunk_name(key)
        try:
            rename = partial(self._dir.rename, temp, final)
            self._index.commit(self._namespace, key, temp, need, rename)
        except TierError:
            self._dir.remove(final, inode)
            raise

    def _load(self, key: bytes, out: ChunkBuffer) -> bool:
        """Load ``key`` into ``out``; ``False`` if its file is missing or not a regular file."""
        with self._call():
            buf = checked_buffer("out", out)
            if not valid_key(key):
                return False
            try:
                with _os_errors(f"disk load of {key.hex()}"):
                    fd = self._dir.open_regular(chunk_name(key), self._io.open_flags)
            except NotRegular:
                self._counters.add(not_regular_files=1)
                return False
            if fd is None:
                self._vanished(key)
                return False
            try:
                inode = os.fstat(fd).st_ino
                with _os_errors(f"disk load of {key.hex()}"):
                    self._io.read_into(fd, (self._namespace, key), buf)
            except CorruptChunkError:
                self._drop(key, inode)
                raise
            finally:
                os.close(fd)
            self._index.touch(self._namespace, key)
            return True

    def _vanished(self, key: bytes) -> None:
        """A file that is gone no longer holds budget (unless a store just put it back)."""
        if self._index.holds(self._namespace, key):
            name = chunk_name(key)
            self._index.forget(self._namespace, key, lambda: self._dir.lstat(name) is None)

    def _drop(self, key: bytes, inode: int) -> None:
        """Drop a chunk that failed verification, unless a store replaced it meanwhile."""
        with contextlib.suppress(TierError):
            self._index.forget(
                self._namespace,
                key,
                lambda: self._dir.remove(chunk_name(key), inode) is not Removal.REPLACED,
            )

    def _remove(self, ns: bytes, key: bytes) -> None:
        """Unlink chunk ``key`` of namespace ``ns`` (an eviction may pick another namespace's);
        never raises, so the evicting transaction always commits."""
        try:
            removal = self._dir.remove_in(ns.hex(), chunk_name(key))
        except OSError:
            self._counters.add(unlink_failures=1)
            return
        if removal is Removal.NOT_REGULAR:
            self._counters.add(not_regular_files=1)

    def _count_evictions(self, evicted: tuple[int, int]) -> None:
        self._counters.add(evictions=evicted[0], evicted_bytes=evicted[1])
