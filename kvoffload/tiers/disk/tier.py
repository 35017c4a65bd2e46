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
  of room (:mod:`~kvoffload.tiers.disk._owners`, :mod:`~kvoffload.tiers.disk._repair`).
* **Atomic stores.** A temp file is renamed over the chunk's name inside the
  index transaction that records it: a crash (even SIGKILL) leaves the old
  chunk, the new one, or a temp file cleaned later. Files are not fsynced: a
  power cut may lose or tear chunks; the checksum makes a torn one a miss.
* **Nothing outside ``disk_path``, nothing that blocks**: regular files only,
  opened relative to the namespace directory (``not_regular_files`` counts
  what is skipped); see :mod:`~kvoffload.tiers.disk._files`.
* **A full disk makes room.** Every step of a store that writes (the
  reservation, the data file, the index commit) meets ``ENOSPC``, ``EDQUOT``
  and a full index alike: it evicts the oldest chunks (what the file system
  lacks) and retries once (``full_retries``); what still fails is a failed
  store (:mod:`~kvoffload.tiers.disk._writer`).
* **A read-only directory is served.** On a ``disk_path`` it may not write
  (a read-only mount, ``chattr +i``, another user's directory) that holds
  chunks of its model, the tier loads them and skips stores
  (``read_only_skips``); one with none is a ``ConfigError``
  (:mod:`~kvoffload.tiers.disk._readonly`).
* **Degrades, never crashes.** An ``OSError`` or SQLite error fails that one
  call with ``TierError`` (counted; translated in :func:`~._files.os_errors` and
  the index); a checksum mismatch drops the chunk (``CorruptChunkError``); a
  vanished file is a miss; an index held by a stuck process fails calls
  after a bounded wait instead of stalling the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvoffload.errors import ConfigError, TierError
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
from kvoffload.tiers.disk._files import Removal, chunk_name, os_errors
from kvoffload.tiers.disk._index import SharedIndex, Totals
from kvoffload.tiers.disk._owners import OwnerLock
from kvoffload.tiers.disk._probe import DiskProbe
from kvoffload.tiers.disk._reader import ChunkReader
from kvoffload.tiers.disk._readonly import namespace_dir, nothing_to_serve, read_only_cause, served
from kvoffload.tiers.disk._repair import audit, reap_dead_writers, reconcile
from kvoffload.tiers.disk._writer import ChunkWriter, count_evictions
from kvoffload.tiers.stats import TierCounters, TierStats

__all__ = ["DiskProbe", "DiskTier"]  # DiskProbe lives apart (no SQLite on the scheduler side)

#: The disk tier's own counters, beside the shared ones of :class:`TierStats`.
COUNTERS = (
    "temp_files_cleaned",
    "unlink_failures",
    "not_regular_files",
    "full_retries",
    "read_only_skips",
    "already_held",
)
logger = logging.getLogger("kvoffload")


class _Closed(TierError):
    """A call after ``close()``."""


class DiskTier(Tier):
    """Chunks as checksummed files under ``path``, all users of ``path`` within ``bytes_to_use``.

    ``namespace`` is the layout fingerprint (``kvoffload.keys.namespace_of``).
    ``direct`` forces O_DIRECT on (``ConfigError`` if refused) or off; ``None``
    probes the directory once (a read-only one reads buffered). Each store and
    load is one vectored syscall in the calling thread: the engine's thread
    pool supplies the parallelism. ``stats()`` reports this process's events
    and the whole path's bytes and chunks (what the budget bounds); read-only,
    what its namespace directory held at start.
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
        self._dir = namespace_dir(Path(path), self._namespace.hex())
        self._lock = threading.Lock()
        self._calls = 0
        self._closed: bool = False
        self._writer: ChunkWriter | None = None
        self._index: SharedIndex | None = None
        try:
            cause = read_only_cause(self._dir.root_fd) or read_only_cause(self._dir.fd)
            if cause is None:
                self._open_writable(direct)
            else:
                self._open_read_only(cause, direct)
        except BaseException:
            self._dir.close()
            raise
        self._reader = ChunkReader(
            self._dir, self._index, self._io, self._counters, self._namespace
        )

    def _open_writable(self, direct: bool | None) -> None:
        with os_errors(f"opening disk_path {str(self._dir.path.parent)!r}", ConfigError):
            owner = OwnerLock(self._dir)
        try:
            with os_errors(f"opening disk_path {str(self._dir.path.parent)!r}", ConfigError):
                probed = probe_direct_io(self._dir.fd, owner.temp_name("probe", 0))
            if direct and not probed:
                raise ConfigError(
                    f"disk_path {str(self._dir.path.parent)!r} refuses O_DIRECT; leave direct unset"
                )
            self._io = ChunkFileIO(probed if direct is None else direct)
            index = SharedIndex(self._dir.path.parent)
            self._recover(index, owner)
        except BaseException:
            owner.release()
            raise
        self._index, self._owner = index, owner
        self._writer = ChunkWriter(
            self._dir,
            index,
            owner,
            self._io,
            self._counters,
            self._namespace,
            self._capacity,
            self._remove,
        )
        self._last = index.totals()

    def _recover(self, index: SharedIndex, owner: OwnerLock) -> None:
        """Clean up after crashed processes and index what the directory holds (at start)."""
        try:
            with os_errors(f"reading {self._dir.path}", ConfigError):
                reap_dead_writers(self._dir, index, owner.token, self._counters)
                reconcile(self._dir, index, self._namespace, owner.token, self._counters)
            count_evictions(self._counters, index.fit(self._capacity, self._remove))
            index.serve()
        except BaseException:
            index.close()
            raise

    def _open_read_only(self, cause: str, direct: bool | None) -> None:
        """Serve what the directory holds; see :mod:`~kvoffload.tiers.disk._readonly`."""
        root = str(self._dir.path.parent)
        with os_errors(f"reading {self._dir.path}", ConfigError):
            held = served(self._dir)
        if not held.chunks:
            raise nothing_to_serve(root, cause)
        self._io = ChunkFileIO(bool(direct))
        self._last = Totals(held.used_bytes, 0, held.chunks)
        logger.warning(
            "disk_path %r is read-only (%s): serving its %d chunks of this model, skipping "
            "stores to the disk tier (counted as read_only_skips)",
            root,
            cause,
            held.chunks,
        )

    @property
    def directory(self) -> Path:
        """The namespace directory holding this tier's files."""
        return self._dir.path

    @property
    def direct_io(self) -> bool:
        """Whether chunks move with O_DIRECT (else buffered I/O)."""
        return self._io.direct

    @property
    def read_only(self) -> bool:
        """Whether the tier serves a directory it may not write (stores are skipped)."""
        return self._writer is None

    # -- the Tier contract --------------------------------------------------

    def put(self, key: bytes, data: ChunkBuffer) -> None:
        """Store ``data`` atomically under ``key``, evicting LRU chunks to stay in budget.

        Raises ``TierError`` (counted) for a bad key, a chunk bigger than the
        budget, a budget held entirely by stores in flight, or an ``OSError``.
        A read-only tier skips it (counted as ``read_only_skips``, not a failure).
        """
        if self._writer is None:
            self._counters.add(read_only_skips=1)
            return
        self._counters.store(lambda: self._store(key, data))

    def get_into(self, key: bytes, out: ChunkBuffer) -> bool:
        """Fill ``out`` with the verified chunk; ``False`` if not held (or not a regular file).

        A corrupt chunk is dropped (a read-only tier leaves it) and raises
        ``CorruptChunkError``; a size mismatch raises ``TierError`` and leaves
        the chunk in place.
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
        """Delete ``key``'s file; not an eviction (the caller asked). Read-only: nothing."""

        def remove() -> bool:
            self._remove(self._namespace, key)
            return True

        if valid_key(key) and self._index is not None:
            with self._call():
                self._index.forget(self._namespace, key, remove)

    def stats(self) -> TierStats:
        """Counters of this process; used/capacity bytes and chunks of the whole path."""
        if self._index is not None:
            with contextlib.suppress(TierError):  # an index busy for long: the last figures
                self._last = self._index.totals()
        totals = self._last
        return self._counters.snapshot(
            used_bytes=totals.used,
            chunks=totals.chunks,
            capacity_bytes=self._capacity,
            gauges={
                "reserved_bytes": totals.reserved,
                "direct_io": int(self._io.direct),
                "read_only": int(self.read_only),
            },
        )

    def check_integrity(self) -> None:
        """Compare the index's totals with its rows, and this namespace's rows with its
        directory (read in one index transaction); raise with numbers. A read-only tier
        keeps no books to compare."""
        if self._index is not None:
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
        if self._index is not None:
            self._index.close()
            self._owner.release()
        self._dir.close()

    def _store(self, key: bytes, data: ChunkBuffer) -> int:
        """Check the key and the buffer, then store (:class:`ChunkWriter`); the payload bytes."""
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
            assert self._writer is not None  # put() skipped the store otherwise
            if not self._writer.store(key, payload):
                self._counters.add(already_held=1)
                return 0  # a store all the same: the tier holds the chunk
            return payload.nbytes

    def _load(self, key: bytes, out: ChunkBuffer) -> bool:
        """Check the key and the buffer, then load (:class:`ChunkReader`)."""
        with self._call():
            buf = checked_buffer("out", out)
            return valid_key(key) and self._reader.load(key, buf)

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
