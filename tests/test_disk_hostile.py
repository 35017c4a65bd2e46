"""The disk tier in a directory it does not control: links, FIFOs, devices, sparse files,
a linked namespace directory, a full file system. Real files, a real tmpfs."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _disk import indexed_keys, reservations, tmpfs

from kvoffload import ConfigError, CorruptChunkError, TierError
from kvoffload.tiers._record import file_bytes
from kvoffload.tiers.disk import DiskProbe, DiskTier

NS = b"\x03" * 16
N = 20_000


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(key: bytes, n: int = N) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(int.from_bytes(key, "little")).bytes(n), np.uint8)


def name_of(key: bytes) -> str:
    return f"{key.hex()}.kv"


def finishes(fn: Callable[[], object]) -> object:
    """``fn()``'s result, run in a thread; fails instead of hanging if ``fn`` blocks."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the call blocked"
    return result[0]


def snapshot(path: Path) -> tuple[bytes, int]:
    """What must never change in a file outside disk_path: its bytes and mtime."""
    return path.read_bytes(), path.stat().st_mtime_ns


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A real chunk file of NS, copied outside disk_path: a link to it would load fine."""
    elsewhere = DiskTier(tmp_path / "elsewhere", 1 << 20, NS)
    elsewhere.put(key_of(1), payload(key_of(1)))
    elsewhere.close()
    target = tmp_path / "outside.kv"
    shutil.copy(tmp_path / "elsewhere" / NS.hex() / name_of(key_of(1)), target)
    os.utime(target, ns=(10**18, 10**18))
    return target


def test_a_link_to_a_file_outside_is_never_followed(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "disk"
    tier = DiskTier(root, 4 * file_bytes(N), NS)
    before = snapshot(outside)
    link = tier.directory / name_of(key_of(1))
    link.symlink_to(outside)
    assert tier.contains_many([key_of(1)]) == [False]
    assert DiskProbe(root, NS).contains_many([key_of(1)]) == [False]
    assert tier.get_into(key_of(1), np.empty(N, np.uint8)) is False
    stats = tier.stats()
    assert (stats.misses, stats.loads, stats.counters["not_regular_files"]) == (1, 0, 1)
    tier.close()
    again = DiskTier(root, 4 * file_bytes(N), NS)  # the start-up scan skips and counts it
    assert again.stats().counters["not_regular_files"] == 1
    assert indexed_keys(root, NS) == [] and again.stats().used_bytes == 0
    assert link.is_symlink() and snapshot(outside) == before  # neither deleted nor touched
    again.put(key_of(1), payload(key_of(1)))  # a store replaces the link, not its target
    assert not link.is_symlink() and snapshot(outside) == before
    assert again.get_into(key_of(1), out := np.empty(N, np.uint8))
    assert np.array_equal(out, payload(key_of(1)))
    again.check_integrity()


def test_eviction_never_deletes_through_or_a_link(tmp_path: Path, outside: Path) -> None:
    tier = DiskTier(tmp_path / "disk", 2 * file_bytes(N), NS)
    before = snapshot(outside)
    tier.put(key_of(1), payload(key_of(1)))
    chunk = tier.directory / name_of(key_of(1))
    chunk.unlink()
    chunk.symlink_to(outside)  # swapped for a link after it was indexed
    tier.put(key_of(2), payload(key_of(2)))
    tier.put(key_of(3), payload(key_of(3)))  # evicts key 1's row; its file is not verifiable
    stats = tier.stats()
    assert stats.evictions == 1 and stats.counters["not_regular_files"] == 1
    assert chunk.is_symlink() and snapshot(outside) == before
    tier.discard(key_of(2))
    assert tier.contains_many([key_of(1), key_of(2), key_of(3)]) == [False, False, True]


def test_a_fifo_never_blocks(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    tier = DiskTier(root, 4 * file_bytes(N), NS)
    fifo = tier.directory / name_of(key_of(1))
    os.mkfifo(fifo)
    assert finishes(lambda: tier.get_into(key_of(1), np.empty(N, np.uint8))) is False
    assert tier.contains_many([key_of(1)]) == [False]
    tier.close()
    again = finishes(lambda: DiskTier(root, 4 * file_bytes(N), NS))  # the scan does not open it
    assert isinstance(again, DiskTier)
    assert again.stats().counters["not_regular_files"] == 1 and stat.S_ISFIFO(fifo.lstat().st_mode)
    again.put(key_of(1), payload(key_of(1)))  # replaces the FIFO
    assert again.get_into(key_of(1), np.empty(N, np.uint8))


def test_devices_and_directories_in_place_of_chunks(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    tier = DiskTier(root, 4 * file_bytes(N), NS)
    device = tier.directory / name_of(key_of(1))
    try:
        os.mknod(device, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("creating a device node needs root with CAP_MKNOD")
    (tier.directory / name_of(key_of(2))).mkdir()
    for key in (key_of(1), key_of(2)):
        assert finishes(lambda k=key: tier.get_into(k, np.empty(N, np.uint8))) is False
    with pytest.raises(TierError, match="failed"):
        tier.put(key_of(2), payload(key_of(2)))  # cannot rename a file over a directory
    tier.put(key_of(3), payload(key_of(3)))  # the tier keeps serving
    stats = tier.stats()
    assert (stats.store_failures, stats.stores, stats.counters["not_regular_files"]) == (1, 1, 2)
    assert reservations(root) == [] and not list(tier.directory.glob("*.tmp"))
    tier.close()
    again = DiskTier(root, 4 * file_bytes(N), NS)
    assert again.stats().counters["not_regular_files"] == 2
    assert stat.S_ISCHR(device.lstat().st_mode) and (tier.directory / name_of(key_of(2))).is_dir()
    assert indexed_keys(root, NS) == [key_of(3)]
    again.check_integrity()


def test_a_linked_namespace_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    files = {name: b"x" * 4096 for name in (name_of(key_of(1)), "00.0123456789abcdef.0.tmp")}
    for name, data in files.items():
        (elsewhere / name).write_bytes(data)
    root = tmp_path / "disk"
    root.mkdir()
    (root / NS.hex()).symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=r"symbolic link.*remove the link"):
        DiskTier(root, 1 << 20, NS)
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == files  # nothing touched
    assert DiskProbe(root, NS).contains_many([key_of(1)]) == [False]


def test_an_index_that_is_a_link_is_refused(tmp_path: Path, outside: Path) -> None:
    before = snapshot(outside)
    root = tmp_path / "disk"
    root.mkdir()
    (root / "kvoffload-index.sqlite3").symlink_to(outside)
    with pytest.raises(ConfigError, match="not a regular file"):
        DiskTier(root, 1 << 20, NS)
    assert snapshot(outside) == before


def test_a_sparse_file_counts_the_blocks_it_occupies(tmp_path: Path) -> None:
    """A 1 TiB sparse file named like a chunk costs its blocks: the real chunks stay."""
    root = tmp_path / "disk"
    budget = 4 * file_bytes(N)
    tier = DiskTier(root, budget, NS)
    for i in range(4):
        tier.put(key_of(i), payload(key_of(i)))
    tier.close()
    sparse = tier.directory / name_of(key_of(9))
    with sparse.open("wb") as f:
        f.truncate(1 << 40)
    if sparse.stat().st_blocks * 512 >= file_bytes(N):
        pytest.skip("this file system allocates sparse files")
    for path in root.glob("kvoffload-index.sqlite3*"):
        path.unlink()  # an index rebuilt from the files alone sees the sparse one too
    again = DiskTier(root, budget, NS)
    stats = again.stats()
    assert stats.evictions == 0 and stats.chunks == 5
    assert stats.used_bytes == 4 * file_bytes(N) + sparse.stat().st_blocks * 512
    for i in range(4):
        assert again.get_into(key_of(i), out := np.empty(N, np.uint8))
        assert np.array_equal(out, payload(key_of(i)))
    with pytest.raises(CorruptChunkError):
        again.get_into(key_of(9), np.empty(N, np.uint8))  # never loads, and is dropped
    assert not sparse.exists() and again.stats().chunks == 4
    again.check_integrity()


# -- a file system that fills up before the budget does --------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs (see ``_disk.mount``)."""
    with tmpfs(tmp_path / "small", "8m") as mnt:
        yield mnt


MIB = 1 << 20


def test_a_full_file_system_makes_room(small_fs: Path) -> None:
    tier = DiskTier(small_fs, 64 * MIB, NS)  # a budget far above what the disk holds
    for i in range(24):
        tier.put(key_of(i), payload(key_of(i), MIB))
    stats = tier.stats()
    assert stats.store_failures == 0 and stats.stores == 24
    assert stats.counters["full_retries"] >= 1 and stats.evictions >= stats.counters["full_retries"]
    assert stats.used_bytes <= 8 * MIB
    keys = indexed_keys(small_fs, NS)
    assert key_of(23) in keys and key_of(0) not in keys  # the oldest made room
    for key in keys:
        assert tier.get_into(key, out := np.empty(MIB, np.uint8))
        assert np.array_equal(out, payload(key, MIB))
    assert reservations(small_fs) == [] and not list(tier.directory.glob("*.tmp"))
    tier.check_integrity()
    tier.close()


def test_a_store_the_disk_can_never_hold_fails_and_evicts_nothing(small_fs: Path) -> None:
    tier = DiskTier(small_fs, 64 * MIB, NS)
    for i in range(3):
        tier.put(key_of(i), payload(key_of(i), MIB))
    with pytest.raises(TierError, match=r"No space left|short write"):
        tier.put(key_of(9), payload(key_of(9), 12 * MIB))
    stats = tier.stats()
    assert (stats.store_failures, stats.evictions, stats.counters["full_retries"]) == (1, 0, 0)
    assert indexed_keys(small_fs, NS) == [key_of(i) for i in range(3)]
    assert reservations(small_fs) == [] and not list(tier.directory.glob("*.tmp"))
    tier.put(key_of(3), payload(key_of(3), MIB))  # and it keeps serving
    tier.check_integrity()
    tier.close()


def fill(path: Path) -> None:
    """Write ``path`` until the file system has no byte left."""
    block = b"\xff" * (64 << 10)
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_a_full_disk_under_the_index_makes_room_too(small_fs: Path) -> None:
    """Something else filled the disk: the index cannot record a reservation until the
    oldest chunks go (SQLite reports the disk full), then the store goes through."""
    tier = DiskTier(small_fs, 64 * MIB, NS)
    for i in range(3):
        tier.put(key_of(i), payload(key_of(i), MIB))
    fill(small_fs / "filler")
    tier.put(key_of(3), payload(key_of(3), MIB))
    stats = tier.stats()
    assert (stats.store_failures, stats.counters["full_retries"]) == (0, 1)
    assert stats.evictions == 2 and indexed_keys(small_fs, NS) == [key_of(2), key_of(3)]
    assert tier.get_into(key_of(3), out := np.empty(MIB, np.uint8))
    assert np.array_equal(out, payload(key_of(3), MIB))
    tier.check_integrity()
    tier.close()


def test_a_full_disk_at_the_index_commit_makes_room_too(small_fs: Path) -> None:
    """The data file fits, then the index cannot record it ("database or disk is full"):
    the commit makes room and retries like the other write steps.

    The room left past the data file goes from none to 32 KiB, a page at a time, so some
    store finds room for its reservation and its data file but not for the commit's log
    pages (with SQLite 3.40, 8 to 20 KiB); each store goes through, once having made room.
    """
    retried = []
    for pages in range(9):
        for entry in small_fs.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        tier = DiskTier(small_fs, 64 * MIB, NS)
        for i in range(3):
            tier.put(key_of(i), payload(key_of(i), MIB))
        fill(small_fs / "filler")
        room = file_bytes(MIB) + pages * 4096
        os.truncate(small_fs / "filler", (small_fs / "filler").stat().st_size - room)
        tier.put(key_of(3), payload(key_of(3), MIB))
        stats = tier.stats()
        assert stats.store_failures == 0 and stats.counters["full_retries"] <= 1, pages
        assert (stats.evictions > 0) == (stats.counters["full_retries"] == 1)
        if stats.counters["full_retries"]:
            retried.append(pages)
        assert tier.get_into(key_of(3), out := np.empty(MIB, np.uint8))
        assert np.array_equal(out, payload(key_of(3), MIB))
        assert reservations(small_fs) == [] and not list(tier.directory.glob("*.tmp"))
        tier.check_integrity()
        tier.close()
    # Too little room for the reservation (none, a page), then for the commit alone.
    assert retried == list(range(len(retried))) and len(retried) >= 3, retried
