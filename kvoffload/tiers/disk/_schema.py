"""The shared index's file: its schema, and opening it safely while other processes do too.

Processes that start together on a new ``disk_path`` all create the index at
once. SQLite answers some of those collisions (switching a new file to WAL,
a lock it cannot wait for without risking a deadlock) with "database is
locked" at once, without waiting, so :func:`open_index` retries them until
its deadline: no process fails to start because another started with it. The
check that the file is kvoffload's, the schema and its version are one
transaction, so no process sees another's half-made schema.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import stat
import time
from pathlib import Path

from kvoffload.errors import ConfigError

__all__ = ["INDEX_NAME", "LOCK_NAME", "WriterLock", "open_index"]

INDEX_NAME = "kvoffload-index.sqlite3"
#: The file writers ``flock`` before they open a transaction (:class:`WriterLock`).
LOCK_NAME = "kvoffload-index.lock"
#: The first and the longest pause between two tries of a busy writer lock, in seconds.
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 50e-6, 1e-3
#: "KVOF": marks the file as kvoffload's; ``user_version`` is the schema's version.
_APPLICATION_ID, _VERSION = 0x4B564F46, 1
#: Pages the WAL may reach before SQLite checkpoints it (SQLite's default; 4 MiB).
_WAL_PAGES = 1000
_LOCKED = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS chunks (ns BLOB NOT NULL, key BLOB NOT NULL, "
    "bytes INTEGER NOT NULL, used_ns INTEGER NOT NULL, PRIMARY KEY (ns, key)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS chunks_by_use ON chunks (used_ns)",
    "CREATE TABLE IF NOT EXISTS writes (ns BLOB NOT NULL, name TEXT NOT NULL, "
    "owner TEXT NOT NULL, bytes INTEGER NOT NULL, PRIMARY KEY (ns, name)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS totals (one INTEGER PRIMARY KEY CHECK (one = 1), "
    "used INTEGER NOT NULL, reserved INTEGER NOT NULL, chunks INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO totals VALUES (1, 0, 0, 0)",
    # The totals follow every row change, so used and reserved bytes are read in O(1).
    "CREATE TRIGGER IF NOT EXISTS chunk_added AFTER INSERT ON chunks BEGIN "
    "UPDATE totals SET used = used + new.bytes, chunks = chunks + 1; END",
    "CREATE TRIGGER IF NOT EXISTS chunk_removed AFTER DELETE ON chunks BEGIN "
    "UPDATE totals SET used = used - old.bytes, chunks = chunks - 1; END",
    "CREATE TRIGGER IF NOT EXISTS chunk_resized AFTER UPDATE OF bytes ON chunks BEGIN "
    "UPDATE totals SET used = used - old.bytes + new.bytes; END",
    "CREATE TRIGGER IF NOT EXISTS write_added AFTER INSERT ON writes BEGIN "
    "UPDATE totals SET reserved = reserved + new.bytes; END",
    "CREATE TRIGGER IF NOT EXISTS write_removed AFTER DELETE ON writes BEGIN "
    "UPDATE totals SET reserved = reserved - old.bytes; END",
)


def open_index(path: Path, timeout_s: float) -> sqlite3.Connection:
    """A connection to the index at ``path`` (created 0600 if missing), in WAL mode, its
    schema in place; ``ConfigError`` if it is not a regular file, not kvoffload's, or
    unusable. Transactions wait up to ``timeout_s`` for other processes."""
    try:
        _prepare_file(path)
    except OSError as exc:
        raise ConfigError(f"disk tier index {str(path)!r}: {exc.strerror}") from exc
    db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not _setup(db):  # another process holds a lock SQLite does not wait for
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError(f"still locked after {timeout_s:.0f} s")
            time.sleep(0.01)
    except BaseException as exc:
        db.close()
        if isinstance(exc, sqlite3.Error):
            raise ConfigError(
                f"disk tier index {str(path)!r} is unusable ({exc}); if it is damaged, "
                "remove it (the index is rebuilt from the chunk files)"
            ) from exc
        raise
    return db


class WriterLock:
    """One writer at a time across processes, taken before SQLite's own lock.

    SQLite makes a writer that finds the index locked sleep 1 ms, then 2, 5,
    10... before it looks again; tensor-parallel ranks store their shards of a
    chunk at the same instant, so each would lose milliseconds per store. This
    ``flock`` is tried again after 50 us, doubling to 1 ms, so a writer waits
    about as long as the transaction ahead of it lasts, and never longer than
    the caller's deadline (a stuck process fails calls; it never stalls them).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        _prepare_file(path)
        self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)

    def acquire(self, timeout_s: float) -> None:
        """Take the lock; ``TimeoutError`` if another process held it ``timeout_s`` long."""
        deadline, pause = time.monotonic() + timeout_s, _FIRST_PAUSE_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.path} held for over {timeout_s:.0f} s") from None
                time.sleep(pause)
                pause = min(2 * pause, _LONGEST_PAUSE_S)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


def _prepare_file(path: Path) -> None:
    """Create ``path`` 0600 (SQLite gives an index's ``-wal`` and ``-shm`` the same mode) and
    refuse one that is not a regular file: it would be followed."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    for name in (path.name, f"{path.name}-wal", f"{path.name}-shm"):
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(path.with_name(name)).st_mode):
                raise ConfigError(
                    f"disk tier index {str(path.with_name(name))!r} is not a regular file; "
                    "remove it (the index is rebuilt from the chunk files)"
                )


def _setup(db: sqlite3.Connection) -> bool:
    """WAL mode and the schema; ``False`` if another process's lock is in the way."""
    try:
        if db.execute("PRAGMA journal_mode = WAL").fetchone()[0] != "wal":
            return False  # the switch needs the file alone for an instant
        db.execute("PRAGMA synchronous = NORMAL")  # chunk files are not fsynced either
        # Checkpoints (two fsyncs, ~5 ms each here) every 1000 pages, and the WAL cut back
        # to that after one: it shares the disk with the chunks.
        db.execute(f"PRAGMA wal_autocheckpoint = {_WAL_PAGES}")
        db.execute(f"PRAGMA journal_size_limit = {_WAL_PAGES * 4096}")
        db.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode & 0xFF in _LOCKED:
            return False
        raise
    try:
        _create_schema(db)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return True


def _create_schema(db: sqlite3.Connection) -> None:
    app, version = db.execute("SELECT * FROM pragma_application_id, pragma_user_version").fetchone()
    if (app, version) not in ((0, 0), (_APPLICATION_ID, _VERSION)):
        raise ConfigError(
            f"{db.execute('PRAGMA database_list').fetchone()[2]!r} is not a kvoffload disk "
            f"index of version {_VERSION} (application id {app:#x}, version {version}); "
            "remove it or point disk_path elsewhere"
        )
    for statement in _SCHEMA:
        db.execute(statement)
    db.execute(f"PRAGMA application_id = {_APPLICATION_ID}")
    db.execute(f"PRAGMA user_version = {_VERSION}")
