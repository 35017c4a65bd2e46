"""The index every process on one ``disk_path`` shares: SQLite in WAL mode.

Several engines may use one ``disk_path`` (data-parallel replicas, several
servers of one model, the tensor-parallel ranks of one server, other models).
They must see each other's chunks, keep *together* within one
``disk_bytes_to_use``, evict in one least-recently-used order, and never
delete each other's writes in flight. That needs state that every process
reads and changes atomically and that survives a ``kill -9`` at any
instruction. The options, and why this one:

* **An in-memory index per process** (what the tier had): each budgets alone
  (two filled 1.9x the budget).
* **File locks and a directory scan per eviction**: choosing a victim means
  ``stat``-ing every chunk under the lock (tens of milliseconds at tens of
  thousands), and reserved bytes kept in a file need their own crash recovery.
* **Per-process subdirectories with a shared eviction sweep**: the budget
  holds only between sweeps, and a lookup must ask every subdirectory.
* **A small shared index in SQLite (WAL)**, what python-diskcache does: one
  ``BEGIN IMMEDIATE`` transaction reserves a store's bytes, evicting the
  oldest chunks (an indexed ``ORDER BY used_ns``) until the reservation
  fits, and a second renames the finished file into place and records it;
  a crash rolls a transaction back whole. Readers never wait (WAL).
  Measured on this project's busy 2-core machine (docs/benchmarks.md), the
  two transactions add about 0.35 ms to a store (against 2-25 ms to write a
  chunk of 0.25-16 MiB there); lookups do not touch the index at all (a
  chunk exists when its file does: one ``lstat`` per key, within 15% of a
  plain ``os.stat``). ``sqlite3`` is in the standard library.

Layout: ``<disk_path>/kvoffload-index.sqlite3`` (plus SQLite's ``-wal`` and
``-shm``), one row per chunk (namespace, key, bytes, last use) and one per
store in flight (its temp file, owner and bytes); triggers keep the totals
row, so used and reserved bytes are read in O(1). Last-use times of loads
are batched (:data:`TOUCH_BATCH`) and written with the next store, so a load
costs no transaction. The budget holds ``used + reserved``: a store reserves
its whole file before creating it, and eviction unlinks inside the
transaction, so the bytes on disk never exceed what the index counts.

The index must live on a local file system (SQLite's locks are unreliable on
NFS). A file of another kind or version at its name is refused at start.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from kvoffload.errors import TierError
from kvoffload.tiers.disk._schema import INDEX_NAME, LOCK_NAME, WriterLock, open_index

__all__ = ["INDEX_NAME", "TOUCH_BATCH", "Adopted", "Full", "NoSpace", "SharedIndex", "Totals"]

#: Loads whose last-use time waits for the next write transaction, at most.
TOUCH_BATCH = 64
#: How long a transaction waits for another process's: longer means a process is stuck,
#: and the call fails (counted) instead of stalling the engine.
BUSY_TIMEOUT_S = 2.0
#: The same at start, where another process may be repairing a large directory.
START_TIMEOUT_S = 60.0

_T = TypeVar("_T")

#: Unlinks one chunk's file (namespace, key); called inside the evicting transaction.
Remover = Callable[[bytes, bytes], None]


class Totals(NamedTuple):
    """Bytes held by chunks, bytes reserved by stores in flight, and chunks, on the whole path."""

    used: int
    reserved: int
    chunks: int


class Adopted(NamedTuple):
    """A chunk file to index that no store recorded: its key, charged bytes, mtime."""

    key: bytes
    charged: int
    mtime_ns: int


class NoSpace(TierError):
    """The file system holding the index is full (``SQLITE_FULL``): make room, then retry."""


class Full(TierError):
    """A reservation cannot fit even with nothing left to evict; carries the totals."""

    def __init__(self, totals: Totals, need: int, capacity: int) -> None:
        super().__init__(
            f"disk tier full: {totals.used} B stored, {totals.reserved} B reserved by stores "
            f"in flight, {need} B needed, capacity {capacity} B"
        )
        self.totals = totals


class SharedIndex:
    """The shared index of one ``disk_path``; see the module docstring.

    One connection per tier, serialised by a thread lock (calls come from the
    engine's worker threads). Every SQLite error is a ``TierError`` for that
    call (at start, a ``ConfigError``).
    """

    def __init__(self, root: Path) -> None:
        self.path = root / INDEX_NAME
        self._lock = threading.Lock()
        self._touched: dict[tuple[bytes, bytes], int] = {}
        self._db = open_index(self.path, START_TIMEOUT_S)
        try:
            self._writer = WriterLock(root / LOCK_NAME)
        except BaseException:
            self._db.close()
            raise
        self._timeout_s = START_TIMEOUT_S

    def serve(self) -> None:
        """Start-up is over: from now on a transaction waits at most :data:`BUSY_TIMEOUT_S`."""
        with self._lock:
            self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self._timeout_s = BUSY_TIMEOUT_S

    def close(self) -> None:
        with contextlib.suppress(TierError):
            self.flush_touches()
        with self._lock:
            self._db.close()
            self._writer.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction: every other process's writes wait for it."""
        with self._lock:
            try:
                self._writer.acquire(self._timeout_s)
            except (TimeoutError, OSError) as exc:
                raise TierError(f"disk index {self.path}: {exc}") from exc
            try:
                yield from self._transaction()
            finally:
                self._writer.release()

    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise TierError(f"disk index {self.path} is busy or unusable: {exc}") from exc
        try:
            yield db
            db.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                error = NoSpace if full else TierError
                raise error(f"disk index {self.path}: {exc}") from exc
            raise

    # -- stores ---------------------------------------------------------------

    def reserve(
        self, write: tuple[bytes, str, str], need: int, capacity: int, remove: Remover
    ) -> tuple[int, int]:
        """Hold ``need`` bytes for temp file ``write`` (namespace, name, owner), evicting the
        least recently used chunks of the whole path first; ``(evicted, bytes)``.

        Raises :class:`Full`, evicting nothing, when stores in flight hold so
        much that even an empty index would leave no room. Files are unlinked
        inside the transaction, before it commits, so the bytes on disk never
        exceed what the index counts.
        """
        with self.transaction() as db:
            self._write_touches(db)
            totals = _totals(db)
            if totals.reserved + need > capacity:
                raise Full(totals, need, capacity)
            freed = _evict(db, totals, lambda t: t.used + t.reserved + need <= capacity, remove)
            db.execute("INSERT INTO writes VALUES (?, ?, ?, ?)", (*write, need))
            return freed

    def fit(self, capacity: int, remove: Remover) -> tuple[int, int]:
        """Evict the least recently used chunks until the path is within ``capacity``."""
        with self.transaction() as db:
            return _evict(db, _totals(db), lambda t: t.used + t.reserved <= capacity, remove)

    def commit(
        self, ns: bytes, key: bytes, name: str, size: int, rename: Callable[[], None]
    ) -> None:
        """Swap the reservation of ``name`` for chunk ``key`` of ``size`` bytes, and call
        ``rename`` (temp file to chunk file) inside the same transaction."""
        with self.transaction() as db:
            db.execute("DELETE FROM writes WHERE ns = ? AND name = ?", (ns, name))
            db.execute(
                "INSERT INTO chunks VALUES (?, ?, ?, ?) ON CONFLICT (ns, key) DO UPDATE "
                "SET bytes = excluded.bytes, used_ns = excluded.used_ns",
                (ns, key, size, time.time_ns()),
            )
            rename()

    def release(self, ns: bytes, name: str) -> None:
        """Drop the reservation of a store that failed (its temp file is already gone)."""
        with self.transaction() as db:
            db.execute("DELETE FROM writes WHERE ns = ? AND name = ?", (ns, name))

    def evict(self, wanted: int, remove: Remover) -> tuple[int, int] | None:
        """Evict the oldest chunks until ``wanted`` bytes are freed (the file system is full);
        ``None``, evicting nothing, if the index does not hold that much."""
        with self.transaction() as db:
            totals = _totals(db)
            if totals.used < wanted:
                return None
            return _evict(db, totals, lambda t: totals.used - t.used >= wanted, remove)

    def forget(self, ns: bytes, key: bytes, remove: Callable[[], bool]) -> None:
        """Drop chunk ``key``'s row if ``remove()`` (run inside the transaction: it deals
        with the file and says whether the row should go) returns ``True``."""
        with self.transaction() as db:
            if remove():
                db.execute("DELETE FROM chunks WHERE ns = ? AND key = ?", (ns, key))

    def holds(self, ns: bytes, key: bytes) -> bool:
        """Whether a row names chunk ``key`` (its file may have vanished since)."""
        return bool(self._read("SELECT 1 FROM chunks WHERE ns = ? AND key = ?", ns, key))

    # -- loads ----------------------------------------------------------------

    def touch(self, ns: bytes, key: bytes) -> None:
        """Record a load's use of ``key``; written with the next store or batch."""
        with self._lock:
            self._touched[ns, key] = time.time_ns()
            full = len(self._touched) >= TOUCH_BATCH
        if full:
            with contextlib.suppress(TierError):  # recency is a hint; the load succeeded
                self.flush_touches()

    def flush_touches(self) -> None:
        with self.transaction() as db:
            self._write_touches(db)

    def _write_touches(self, db: sqlite3.Connection) -> None:
        touched, self._touched = self._touched, {}
        if touched:
            db.executemany(
                "UPDATE chunks SET used_ns = ? WHERE ns = ? AND key = ?",
                [(used, ns, key) for (ns, key), used in touched.items()],
            )

    # -- reads and repairs ----------------------------------------------------

    def totals(self) -> Totals:
        return Totals(*self._read("SELECT used, reserved, chunks FROM totals")[0])

    def writers(self) -> list[tuple[bytes, str]]:
        """(namespace, owner) of every store in flight, whoever it belongs to."""
        return self._read("SELECT DISTINCT ns, owner FROM writes")

    def reap(self, ns: bytes, owner: str, cleanup: Callable[[str], Adopted | None]) -> int:
        """Drop the reservations of ``owner`` (known to have exited); ``cleanup(name)``
        removes each temp file and returns the chunk file to index if the owner died
        between renaming it and recording it. Returns the reservations dropped."""
        with self.transaction() as db:
            names = [
                n
                for (n,) in db.execute(
                    "SELECT name FROM writes WHERE ns = ? AND owner = ?", (ns, owner)
                )
            ]
            for name in names:
                adopted = cleanup(name)
                if adopted is not None:
                    _adopt(db, ns, adopted)
            db.execute("DELETE FROM writes WHERE ns = ? AND owner = ?", (ns, owner))
            return len(names)

    def reconcile(self, ns: bytes, scan: Callable[[], list[Adopted]]) -> tuple[int, int]:
        """Make namespace ``ns``'s rows match its directory: ``scan()`` runs inside the
        transaction (no rename can interleave); files without a row are indexed (their
        mtime as last use), rows without a file dropped. Returns (indexed, dropped)."""
        with self.transaction() as db:
            found = scan()
            before = {k for (k,) in db.execute("SELECT key FROM chunks WHERE ns = ?", (ns,))}
            for chunk in found:
                if chunk.key not in before:
                    _adopt(db, ns, chunk)
            gone = before - {chunk.key for chunk in found}
            db.executemany("DELETE FROM chunks WHERE ns = ? AND key = ?", [(ns, k) for k in gone])
            return len(found) - (len(before) - len(gone)), len(gone)

    def audit(
        self, ns: bytes, scan: Callable[[], _T]
    ) -> tuple[Totals, Totals, dict[bytes, int], _T]:
        """Totals, totals recounted from the rows, ``ns``'s rows and ``scan()`` of its
        directory, all read in one transaction (``check_integrity`` compares them)."""
        with self.transaction() as db:
            rows = dict(db.execute("SELECT key, bytes FROM chunks WHERE ns = ?", (ns,)))
            used, chunks = db.execute("SELECT TOTAL(bytes), COUNT(*) FROM chunks").fetchone()
            [reserved] = db.execute("SELECT TOTAL(bytes) FROM writes").fetchone()
            return _totals(db), Totals(int(used), int(reserved), chunks), rows, scan()

    def _read(self, sql: str, *args: object) -> list[Any]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise TierError(f"disk index {self.path}: {exc}") from exc


def _totals(db: sqlite3.Connection) -> Totals:
    return Totals(*db.execute("SELECT used, reserved, chunks FROM totals").fetchone())


def _adopt(db: sqlite3.Connection, ns: bytes, chunk: Adopted) -> None:
    db.execute(
        "INSERT OR IGNORE INTO chunks VALUES (?, ?, ?, ?)",
        (ns, chunk.key, chunk.charged, chunk.mtime_ns),
    )


def _evict(
    db: sqlite3.Connection, totals: Totals, done: Callable[[Totals], bool], remove: Remover
) -> tuple[int, int]:
    """Evict least recently used chunks, starting from ``totals``, until ``done(totals)``;
    ``(chunks, bytes)`` evicted. (The triggers update the stored totals alike.)"""
    count = freed = 0
    while not done(totals) and totals.chunks:
        ns, key, size = db.execute(
            "SELECT ns, key, bytes FROM chunks ORDER BY used_ns LIMIT 1"
        ).fetchone()
        remove(ns, key)
        db.execute("DELETE FROM chunks WHERE ns = ? AND key = ?", (ns, key))
        count, freed = count + 1, freed + size
        totals = Totals(totals.used - size, totals.reserved, totals.chunks - 1)
    return count, freed
