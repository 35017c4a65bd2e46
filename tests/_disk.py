"""Helpers of the disk tier tests: read the shared index and the directory as another process."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvoffload.tiers.disk._index import INDEX_NAME


def _query(root: Path, sql: str, *args: object) -> list[tuple[object, ...]]:
    db = sqlite3.connect(f"file:{root / INDEX_NAME}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def indexed_keys(root: Path, namespace: bytes) -> list[bytes]:
    """The keys of ``namespace`` in the index under ``root``, least recently used first."""
    rows = _query(root, "SELECT key FROM chunks WHERE ns = ? ORDER BY used_ns", namespace)
    return [bytes(key) for (key,) in rows]  # type: ignore[arg-type]


def reservations(root: Path) -> list[tuple[str, str, int]]:
    """(temp file, owner, bytes) of every store in flight the index records."""
    return _query(root, "SELECT name, owner, bytes FROM writes")  # type: ignore[return-value]


def bytes_in_files(root: Path) -> int:
    """Bytes of every chunk and chunk temp file under ``root`` (what the budget bounds)."""
    total = 0
    for directory in root.iterdir():
        if not directory.is_dir() or directory.is_symlink():
            continue
        for entry in directory.iterdir():
            if entry.suffix == ".kv" or (entry.suffix == ".tmp" and entry.name[0] != "p"):
                try:
                    total += entry.lstat().st_size
                except FileNotFoundError:  # evicted or renamed while we looked
                    continue
    return total
