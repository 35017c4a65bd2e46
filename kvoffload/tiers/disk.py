"""The disk tier: one verified file per chunk, bounded by ``disk_bytes_to_use``.

Layout: ``<disk_path>/<namespace fingerprint hex>/<key hex>.kv``, directories
created 0700 and files 0600. File names are built from hex only, never from a
user string. The file format and checksum are described in
:mod:`kvoffload.tiers._chunk_file`.

Why it is built this way:

* **Atomic stores.** A chunk is written to ``<key hex>.<random hex>.tmp`` and
  renamed over its final name, so a crash (even SIGKILL mid-write) leaves
  either the old chunk, the new one, or a temp file that start-up deletes.
  Files are not fsynced: a power cut may lose chunks or leave torn ones, and
  the checksum turns a torn one into a miss, never into wrong KV.
* **Its own bound.** Unlike a plain file cache that fills the disk, the tier
  keeps an LRU index (by last store or load) and evicts inside its budget
  before writing. Evictions are counted in its stats and told to nobody: the
  scheduler side asks the directory what it holds (:class:`DiskProbe`), so
  there is no second index to keep in step.
* **Warm restart.** The index is rebuilt at start from the namespace
  directory, oldest mtime first; loads refresh a file's mtime so the LRU order
  survives a restart. Another namespace lives in another directory and
  carries its fingerprint in every header, so it never sees these chunks.
* **Degrades, never crashes.** ``ENOSPC``, ``EACCES``, ``EIO`` and a full
  budget fail that one call with ``TierError`` (chained from the ``OSError``,
  translated in one place, :func:`_os_errors`); a checksum mismatch drops the
  chunk and raises ``CorruptChunkError``; a file that vanished is a miss.
  Each is counted, and the tier keeps serving.

One process owns a namespace directory at a time: the index is in memory and
start-up removes temp files, which would break a second live writer.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvoffload.errors import ConfigError, CorruptChunkError, IntegrityError, TierError
from kvoffload.tiers._chunk_file import MAX_KEY_BYTES, ChunkFileIO, file_bytes
from kvoffload.tiers._direct_io import probe_direct_io
from kvoffload.tiers._disk_checks import (
    check_budget,
    checked_buffer,
    make_private_dir,
    namespace_fingerprint,
    valid_key,
)
from kvoffload.tiers.base import ChunkBuffer, Tier
from kvoffload.tiers.stats import TierCounters, TierStats

__all__ = ["DiskProbe", "DiskTier"]

_CHUNK_NAME = re.compile(rf"([0-9a-f]{{2,{2 * MAX_KEY_BYTES}}})\.kv")


@contextlib.contextmanager
def _os_errors(what: str, error: type[TierError | ConfigError] = TierError) -> Iterator[None]:
    """The disk tier's one translation of ``OSError``: ``TierError`` for a call (that call
    fails, the tier serves on), ``ConfigError`` at start-up (the directory is unusable)."""
    try:
        yield
    except OSError as exc:
        raise error(f"{what} failed: {exc}") from exc


class DiskTier(Tier):
    """Chunks as checksummed files under ``path``, at most ``bytes_to_use`` bytes of them.

    ``namespace`` is the layout fingerprint (``kvoffload.keys.namespace_of``).
    ``direct`` forces O_DIRECT on (``ConfigError`` if refused) or off; ``None``
    probes the directory once. Each store and load is one vectored syscall in
    the calling thread: the engine's thread pool supplies the parallelism
    (segmenting a chunk over an internal pool measured no faster here).
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
        self._dir = Path(path) / self._namespace.hex()
        make_private_dir(Path(path))
        make_private_dir(self._dir)
        probed = probe_direct_io(self._dir)
        if direct and not probed:
            raise ConfigError(f"disk_path {str(path)!r} refuses O_DIRECT; leave direct unset")
        self._io = ChunkFileIO(probed if direct is None else direct)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._used = 0
        self._reserved = 0
        self._counters = TierCounters(self.name, ("temp_files_cleaned", "unlink_failures"))
        self._closed = False
        with _os_errors(f"reading disk_path {str(path)!r}", ConfigError):
            self._rebuild_index()

    @property
    def directory(self) -> Path:
        """The namespace directory holding this tier's files."""
        return self._dir

    @property
    def direct_io(self) -> bool:
        """Whether chunks move with O_DIRECT (else buffered I/O)."""
        return self._io.direct

    def _path(self, key: bytes) -> Path:
        return self._dir / f"{key.hex()}.kv"

    def _rebuild_index(self) -> None:
        """Index the chunks a previous process left, oldest first; delete its temp files."""
        found: list[tuple[int, bytes, int]] = []
        with os.scandir(self._dir) as entries:
            for entry in entries:
                if entry.name.endswith(".tmp"):
                    self._unlink(Path(entry.path))
                    self._counters.add(temp_files_cleaned=1)
                elif (match := _CHUNK_NAME.fullmatch(entry.name)) and len(match[1]) % 2 == 0:
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, bytes.fromhex(match[1]), st.st_size))
        with self._lock:
            for _, key, size in sorted(found):
                self._index[key] = size
                self._used += size
            while self._used > self._capacity:
                self._evict_one(exclude=None)

    # -- the Tier contract --------------------------------------------------

    def put(self, key: bytes, data: ChunkBuffer) -> None:
        """Store ``data`` atomically under ``key``, evicting LRU chunks to stay in budget.

        Raises ``TierError`` (counted) for a bad key, a chunk bigger than the
        budget, a budget held entirely by stores in flight, or an ``OSError``.
        """
        self._counters.store(lambda: self._write(key, data))

    def get_into(self, key: bytes, out: ChunkBuffer) -> bool:
        """Fill ``out`` with the verified chunk; ``False`` if not held (or the file vanished).

        A corrupt chunk is dropped and raises ``CorruptChunkError``; a size
        mismatch raises ``TierError`` and leaves the chunk in place.
        """
        return self._counters.load(out.nbytes, lambda: self._read(key, out))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the index holds each key (a file may still turn out corrupt)."""
        with self._lock:
            return [key in self._index for key in keys]

    def discard(self, key: bytes) -> None:
        """Delete ``key``'s file; not an eviction (the caller asked)."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
                self._unlink(self._path(key))

    def stats(self) -> TierStats:
        """Counters plus live sizes: chunks, used/capacity bytes; reserved bytes, direct_io."""
        with self._lock:
            chunks, used, reserved = len(self._index), self._used, self._reserved
        return self._counters.snapshot(
            used_bytes=used,
            chunks=chunks,
            capacity_bytes=self._capacity,
            gauges={"reserved_bytes": reserved, "direct_io": int(self._io.direct)},
        )

    def check_integrity(self) -> None:
        """Compare the index with its own accounting and with the directory; raise with numbers."""
        with self._lock, _os_errors(f"listing {self._dir}"):
            total = sum(self._index.values())
            if total != self._used or self._used > self._capacity or self._reserved < 0:
                raise IntegrityError(
                    f"disk index: files sum to {total} B, used {self._used} B, "
                    f"reserved {self._reserved} B, capacity {self._capacity} B"
                )
            on_disk = {
                bytes.fromhex(m[1]): e.stat().st_size
                for e in os.scandir(self._dir)
                if (m := _CHUNK_NAME.fullmatch(e.name))
            }
            wrong = {
                k.hex(): (s, on_disk.get(k)) for k, s in self._index.items() if on_disk.get(k) != s
            }
            extra = len(on_disk.keys() - self._index.keys())
            if wrong or extra:
                sample = dict(list(wrong.items())[:3])
                raise IntegrityError(
                    f"disk index disagrees with {self._dir}: {len(wrong)} entries with a "
                    f"missing or resized file (key: (indexed, on disk) {sample}), "
                    f"{extra} unindexed files"
                )

    def close(self) -> None:
        """Refuse further calls; files stay for a warm restart. Calls in flight finish."""
        with self._lock:
            self._closed = True

    # -- internals ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("disk tier is closed")

    def _write(self, key: bytes, data: ChunkBuffer) -> int:
        """Reserve room, write a temp file, rename it into place; the payload bytes stored."""
        self._check_open()
        payload = checked_buffer("data", data)
        if not valid_key(key):
            raise TierError(f"DiskTier: key must be 1 to {MAX_KEY_BYTES} bytes, got {key!r:.80}")
        need = file_bytes(payload.nbytes)
        self._reserve(key, need)
        tmp = self._dir / f"{key.hex()}.{secrets.token_hex(8)}.tmp"
        committed = False
        try:
            with _os_errors(f"disk store of {key.hex()}"):
                self._io.write(tmp, (self._namespace, key), payload)
                committed = self._commit(key, tmp, need)
        finally:
            if not committed:
                with self._lock:
                    self._reserved -= need
                    self._unlink(tmp)
        return payload.nbytes

    def _read(self, key: bytes, out: ChunkBuffer) -> bool:
        """Load ``key`` into ``out``; ``False`` if not indexed or its file is gone."""
        self._check_open()
        buf = checked_buffer("out", out)
        with self._lock:
            if key not in self._index:
                return False
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            with _os_errors(f"disk load of {key.hex()}"):
                found = self._io.read_into(path, (self._namespace, key), buf)
        except CorruptChunkError:
            self._forget(key)
            raise
        if not found:
            self._forget(key)
            return False
        with contextlib.suppress(OSError):
            os.utime(path)  # keeps LRU order across restarts; best effort
        return True

    def _reserve(self, key: bytes, need: int) -> None:
        """Make room for ``need`` bytes by evicting LRU chunks, then hold it for this store.

        The chunk being replaced is never a victim and its bytes count as free:
        the rename frees them. Two concurrent stores of one key may overshoot
        the budget by one chunk until the second commits.
        """
        with self._lock:
            if need > self._capacity:
                raise TierError(
                    f"chunk needs {need} B on disk, more than disk_bytes_to_use {self._capacity} B"
                )
            freeable = self._index.get(key, 0)
            while self._used + self._reserved + need - freeable > self._capacity:
                if not self._evict_one(exclude=key):
                    raise TierError(
                        f"disk tier full: {self._used} B stored, {self._reserved} B reserved by "
                        f"stores in flight, {need} B needed, capacity {self._capacity} B"
                    )
            self._reserved += need

    def _commit(self, key: bytes, tmp: Path, need: int) -> bool:
        """Rename the finished temp file into place and index it (under the lock, so an
        eviction or drop of the same key cannot interleave between rename and index)."""
        with self._lock:
            os.replace(tmp, self._path(key))
            old = self._index.pop(key, 0)
            self._index[key] = need
            self._used += need - old
            self._reserved -= need
            return True

    def _evict_one(self, exclude: bytes | None) -> bool:
        """Evict the least recently used chunk other than ``exclude``; caller holds the lock."""
        victim = next((k for k in self._index if k != exclude), None)
        if victim is None:
            return False
        size = self._index.pop(victim)
        self._used -= size
        self._unlink(self._path(victim))
        self._counters.add(evictions=1, evicted_bytes=size)
        return True

    def _forget(self, key: bytes) -> None:
        """Drop a chunk that failed to load. If a concurrent store just replaced it, the
        new file goes too: a lost store, never a wrong load (and the probe sees it gone)."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
                self._unlink(self._path(key))

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError:  # best effort: the file is out of the index either way
            self._counters.add(unlink_failures=1)


class DiskProbe:
    """Asks whether chunk files exist in a disk tier another object (or process) owns.

    The scheduler side of a connector plans loads but never touches bytes;
    the worker's :class:`DiskTier` owns the directory. A probe answers from
    the directory itself, so it sees what a previous process left (warm
    restart) and what the owner evicted, with no message between them. Like
    ``Tier.contains`` it is a hint: a file may vanish or prove corrupt before
    the load, which then fails and is recomputed.
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike[str], namespace: bytes) -> None:
        self._dir = Path(path) / namespace_fingerprint(namespace).hex()

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One ``stat`` per key; no index, no lock, nothing created."""
        directory = self._dir
        return [valid_key(key) and (directory / f"{key.hex()}.kv").is_file() for key in keys]

    def close(self) -> None:
        """Nothing to release; present so probes close like tiers."""
