"""Helpers of the disk tier tests: read the shared index and the directory as another process;
mount real file systems (a small tmpfs, an ext4 image) where the tests may."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

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


def mount(args: list[str], what: str) -> None:
    """``mount ARGS``. Mounting needs root with CAP_SYS_ADMIN: elsewhere the test skips,
    except where ``KVOFFLOAD_REQUIRE_MOUNT`` is set (CI), where not mounting is a failure."""
    try:
        done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
        error = done.stderr.strip() if done.returncode else ""
    except FileNotFoundError:
        error = "no mount command"
    if error:
        unavailable(f"cannot mount {what} ({error}): needs root with CAP_SYS_ADMIN")


def unavailable(reason: str) -> None:
    """Skip a test whose real part this machine lacks; fail it in CI."""
    if os.environ.get("KVOFFLOAD_REQUIRE_MOUNT"):
        pytest.fail(reason)
    pytest.skip(reason)


@contextlib.contextmanager
def mounted(mnt: Path, args: list[str], what: str) -> Iterator[Path]:
    """``mnt`` with a file system mounted on it (see :func:`mount`) until the block ends."""
    mnt.mkdir(exist_ok=True)
    mount([*args, str(mnt)], what)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def tmpfs(mnt: Path, size: str) -> contextlib.AbstractContextManager[Path]:
    """A real tmpfs of ``size`` (``8m``) on ``mnt``."""
    return mounted(mnt, ["-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs"], f"a {size} tmpfs")


def remount_read_only(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``root``: (size, mtime), what a read-only user must leave alone."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}  # fmt: skip
