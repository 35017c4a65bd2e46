"""A look inside a ``disk_path`` that changes nothing: what ``kvoffload inspect`` shows.

Engines may be using the directory while it is read, so this opens nothing
for writing and creates, repairs or deletes nothing. The shared index is
opened read-only (SQLite's ``mode=ro`` URI; ``immutable=1`` as well when no
process has it open, so not even SQLite's ``-wal`` and ``-shm`` are created)
and read in one transaction, so its totals and rows agree with each other; a
WAL reader never blocks a writer. Files are ``lstat``-ed, and a chunk file's header block (one 4 KiB
read, opened with ``O_NOFOLLOW | O_NONBLOCK``, never a link, FIFO or device)
is checked as a load checks it: magic, header checksum, namespace, key,
length. ``verify=True`` reads every payload and checks its checksum too.

The index records no budget (each engine brings its ``disk_bytes_to_use``),
so the report gives what is held and what the file system has left.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import numpy as np

from kvoffload.config.offload_config import ALIGN
from kvoffload.errors import ConfigError, CorruptChunkError, TierError
from kvoffload.tiers._record import CHECKSUMS, check_header, file_bytes
from kvoffload.tiers._validation import namespace_fingerprint
from kvoffload.tiers.disk._files import parse_chunk_name
from kvoffload.tiers.disk._owners import FRESH_OWNER, owner_of_temp
from kvoffload.tiers.disk._schema import INDEX_NAME, LOCK_NAME

__all__ = ["DiskReport", "NamespaceReport", "inspect_disk", "stored_chunks"]

#: Files of the index beside the namespace directories: not chunks, not damage.
_INDEX_FILES = {INDEX_NAME, f"{INDEX_NAME}-wal", f"{INDEX_NAME}-shm", LOCK_NAME}
#: A namespace directory is the hex of a 16-byte namespace fingerprint.
_NAMESPACE_HEX = 32
_SAFE_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(slots=True)
class NamespaceReport:
    """One namespace (a model, dtype and layout; one per tensor-parallel rank of a sharded
    layout, one for all ranks of a replicated one)."""

    namespace: str
    #: Chunk files found, and the bytes they occupy on disk.
    files: int = 0
    file_bytes: int = 0
    #: Chunks the shared index records, their bytes, and their oldest and newest last use
    #: (Unix nanoseconds; ``None`` without rows).
    indexed: int = 0
    indexed_bytes: int = 0
    oldest_use_ns: int | None = None
    newest_use_ns: int | None = None
    #: Temp files of stores in flight, or left by a writer that died (an engine reclaims them).
    temp_files: int = 0
    #: ``"name: why"`` for every damaged or foreign entry.
    damaged: list[str] = field(default_factory=list)


@dataclass(slots=True)
class DiskReport:
    """A ``disk_path`` as :func:`inspect_disk` found it."""

    path: str
    #: Whether the shared index exists (a directory no engine used has none).
    index_found: bool
    #: The index's totals: bytes held by chunks, reserved by stores in flight, chunks.
    used_bytes: int
    reserved_bytes: int
    chunks: int
    #: The file system under ``path``: bytes free to this user, and its size.
    free_bytes: int
    fs_bytes: int
    namespaces: list[NamespaceReport]
    #: Entries directly under ``path`` that are neither the index nor a namespace.
    foreign: list[str]

    @property
    def damaged(self) -> int:
        return sum(len(ns.damaged) for ns in self.namespaces)


def inspect_disk(path: str | os.PathLike[str], *, verify: bool = False) -> DiskReport:
    """Read ``path`` without changing it; ``ConfigError`` if it is no directory to read."""
    root = Path(path)
    try:
        st = os.stat(root)
    except OSError as exc:
        raise ConfigError(f"disk_path {str(root)!r} cannot be read: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"disk_path {str(root)!r} is not a directory")
    fs = os.statvfs(root)
    rows, totals = _read_index(root / INDEX_NAME)
    namespaces: dict[str, NamespaceReport] = {}
    foreign = []
    for name in sorted(_list(root)):
        if name in _INDEX_FILES:
            continue
        if len(name) == _NAMESPACE_HEX and _is_hex(name) and _is_plain_dir(root / name):
            namespaces[name] = _scan_namespace(root / name, verify)
        else:
            foreign.append(name)
    for ns, (count, size, oldest, newest) in rows.items():
        report = namespaces.setdefault(ns, NamespaceReport(ns))
        report.indexed, report.indexed_bytes = count, size
        report.oldest_use_ns, report.newest_use_ns = oldest, newest
    return DiskReport(
        path=str(root),
        index_found=totals is not None,
        used_bytes=totals[0] if totals else 0,
        reserved_bytes=totals[1] if totals else 0,
        chunks=totals[2] if totals else 0,
        free_bytes=fs.f_bavail * fs.f_frsize,
        fs_bytes=fs.f_blocks * fs.f_frsize,
        namespaces=sorted(namespaces.values(), key=lambda r: r.namespace),
        foreign=foreign,
    )


def stored_chunks(path: str | os.PathLike[str], namespace: bytes) -> int:
    """Chunk files of ``namespace`` under ``path`` (by name; 0 where there is no directory)."""
    directory = Path(path) / namespace_fingerprint(namespace).hex()
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    return sum(parse_chunk_name(name) is not None for name in names)


def _list(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError as exc:
        raise ConfigError(f"cannot list {str(directory)!r}: {exc.strerror}") from exc


def _is_hex(name: str) -> bool:
    return all(c in "0123456789abcdef" for c in name)


def _is_plain_dir(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(os.lstat(path).st_mode)
    return False


_Rows = dict[str, tuple[int, int, int | None, int | None]]


def _read_index(index: Path) -> tuple[_Rows, tuple[int, int, int] | None]:
    """Per-namespace rows and the totals, read in one read-only transaction."""
    if not index.is_file():
        return {}, None
    # An engine holding the index open keeps its -wal and -shm: read beside it, as a WAL
    # reader (it only marks its read in -shm). Without them nothing has it open, and a
    # read-only connection would still create both: read the file as it stands instead.
    live = all(index.with_name(f"{index.name}{end}").exists() for end in ("-wal", "-shm"))
    uri = f"file:{quote(str(index.resolve()))}?mode=ro" + ("" if live else "&immutable=1")
    try:
        db = sqlite3.connect(uri, uri=True, timeout=5.0, isolation_level=None)
    except sqlite3.Error as exc:
        raise ConfigError(f"disk index {str(index)!r} cannot be opened read-only: {exc}") from exc
    try:
        db.execute("BEGIN")
        totals = db.execute("SELECT used, reserved, chunks FROM totals").fetchone()
        rows = {
            bytes(ns).hex(): (count, size, oldest, newest)
            for ns, count, size, oldest, newest in db.execute(
                "SELECT ns, COUNT(*), SUM(bytes), MIN(used_ns), MAX(used_ns) FROM chunks "
                "GROUP BY ns"
            )
        }
        db.execute("COMMIT")
    except sqlite3.Error as exc:
        raise ConfigError(
            f"disk index {str(index)!r} is unreadable ({exc}); an engine starting on this "
            "path rebuilds it from the chunk files"
        ) from exc
    finally:
        db.close()
    return rows, (tuple(totals) if totals else None)


def _scan_namespace(directory: Path, verify: bool) -> NamespaceReport:
    report = NamespaceReport(directory.name)
    namespace = bytes.fromhex(directory.name)
    for name in sorted(_list(directory)):
        try:
            st = os.lstat(directory / name)
        except FileNotFoundError:  # removed while we listed: an engine evicted it
            continue
        if owner_of_temp(name) is not None or name.endswith((".owner", FRESH_OWNER)):
            report.temp_files += name.endswith(".tmp")
            continue
        key = parse_chunk_name(name)
        if not stat.S_ISREG(st.st_mode):
            report.damaged.append(f"{name}: not a regular file (skipped by every engine)")
            continue
        if key is None:
            report.damaged.append(f"{name}: not a chunk file's name")
            continue
        problem = _check_file(directory / name, (namespace, key), st.st_size, verify)
        if problem is not None:
            report.damaged.append(f"{name}: {problem}")
            continue
        report.files += 1
        report.file_bytes += st.st_blocks * 512
    return report


def _check_file(path: Path, name: tuple[bytes, bytes], size: int, verify: bool) -> str | None:
    """Why the chunk file at ``path`` would fail a load, or ``None`` if it would not."""
    try:
        with _opened(path) as fd:
            block = np.frombuffer(os.pread(fd, ALIGN, 0), dtype=np.uint8)
            if block.size < ALIGN:
                return f"truncated: {size} bytes, shorter than a header"
            try:
                header = check_header(block, name, _payload_length(block))
            except (CorruptChunkError, TierError) as exc:
                return str(exc)
            if size != file_bytes(header.payload_len):
                return f"{size} bytes, a {header.payload_len}-byte chunk needs " + str(
                    file_bytes(header.payload_len)
                )
            if verify:
                payload = os.pread(fd, header.payload_len, ALIGN)
                if CHECKSUMS[header.algorithm](memoryview(payload)) != header.payload_sum:
                    return "payload checksum mismatch"
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    return None


def _payload_length(block: np.ndarray) -> int:
    """The payload length the header claims (checked against the file by the caller)."""
    return int.from_bytes(block[32:40].tobytes(), "little")


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[int]:
    fd = os.open(path, _SAFE_READ)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file")
        yield fd
    finally:
        os.close(fd)
