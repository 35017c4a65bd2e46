"""The disk tier on real files: round trips, corruption, the budget, crashes, restarts."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _disk import indexed_keys, reservations

from kvoffload import TIERS, ConfigError, CorruptChunkError, IntegrityError, TierError
from kvoffload.tiers._record import file_bytes
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.disk._direct_io import ALIGN, aligned_empty
from kvoffload.tiers.disk._repair import STALE_TEMP_S

REPO = Path(__file__).resolve().parents[1]
NS = b"\x01" * 16
SIZES = [1, 4095, 4096, 4097, 65536 + 3, 1 << 20]


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(key: bytes, n: int) -> np.ndarray:
    """Bytes determined by the key, so any process can check what a chunk must hold."""
    return np.frombuffer(np.random.default_rng(int.from_bytes(key, "little")).bytes(n), np.uint8)


def load(tier: DiskTier, key: bytes, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint8)
    assert tier.get_into(key, out), f"{key.hex()} missed"
    return out


def holds(tier: DiskTier, key: bytes) -> bool:
    [found] = tier.contains_many([key])
    return found


def lru_keys(tier: DiskTier) -> list[bytes]:
    """The keys the shared index file holds for the tier's namespace, least recently used
    first: the order eviction picks (read from the index as another process would)."""
    return indexed_keys(tier.directory.parent, bytes.fromhex(tier.directory.name))


def chunk_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix == ".kv")


@pytest.fixture
def tier(tmp_path: Path):
    t = DiskTier(tmp_path / "disk", 64 << 20, NS)
    yield t
    t.close()


def chunk_file(tier: DiskTier, key: bytes) -> Path:
    return tier.directory / f"{key.hex()}.kv"


@pytest.mark.parametrize("direct", [None, False], ids=["probed", "buffered"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_round_trip_is_bit_exact(tmp_path: Path, direct: bool | None, aligned: bool) -> None:
    tier = DiskTier(tmp_path, 64 << 20, NS, direct=direct)
    for i, n in enumerate(SIZES):
        key, data = key_of(i), payload(key_of(i), n)
        src = aligned_empty(n + 1)[:n] if aligned else aligned_empty(n + 1)[1:]
        src[:] = data
        tier.put(key, src)
        out = aligned_empty(n) if aligned else aligned_empty(n + 1)[1:]
        assert tier.get_into(key, out)
        assert np.array_equal(out, data), n
        assert chunk_file(tier, key).stat().st_size == file_bytes(n)
    stats = tier.stats()
    assert stats.stores == stats.loads == stats.chunks == len(SIZES)
    assert stats.store_bytes == stats.load_bytes == sum(SIZES)
    assert stats.used_bytes == sum(file_bytes(n) for n in SIZES)
    assert stats.store_failures == stats.misses == stats.load_failures == 0
    tier.check_integrity()


def _refuses_o_direct(directory: Path) -> bool:
    probe = directory / "probe-by-test"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return True
    os.close(fd)
    probe.unlink()
    return False


@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
def test_probe_picks_direct_or_buffered_io(tmp_path: Path, where: str) -> None:
    """tmpfs refused O_DIRECT before Linux 6.6; either way the tier must work."""
    root = tmp_path if where == "tmp_path" else Path(where)
    if not root.is_dir() or not os.access(root, os.W_OK):
        pytest.skip(f"{where} is not a writable directory here")
    target = root / f"kvoffload-test-{os.getpid()}"
    try:
        tier = DiskTier(target, 1 << 20, NS)
        assert tier.direct_io is not _refuses_o_direct(tier.directory)
        assert tier.stats().gauges["direct_io"] == tier.direct_io
        tier.put(key_of(1), payload(key_of(1), 5000))
        assert np.array_equal(load(tier, key_of(1), 5000), payload(key_of(1), 5000))
        if not tier.direct_io:
            with pytest.raises(ConfigError, match="O_DIRECT"):
                DiskTier(target, 1 << 20, NS, direct=True)
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_directories_are_0700_and_names_are_hex(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    tier = DiskTier(root, 1 << 20, b"some model namespace")
    tier.put(b"\x00\xffkey", payload(b"k", 10))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(root.parent.stat().st_mode) == 0o700  # missing parents too
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700
    assert re.fullmatch(r"[0-9a-f]{32}", tier.directory.name)
    assert chunk_names(tier.directory) == ["00ff6b6579.kv"]
    for path in [*tier.directory.iterdir(), *root.glob("kvoffload-index.sqlite3*")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name  # chunk, owner, index


def test_bad_keys_and_buffers_fail_the_call(tier: DiskTier) -> None:
    data = payload(b"k", 100)
    for key in (b"", b"x" * 121, "text"):
        with pytest.raises(TierError, match="key"):
            tier.put(key, data)  # type: ignore[arg-type]
        assert not holds(tier, key)  # type: ignore[arg-type]
    with pytest.raises(TierError, match="uint8"):
        tier.put(b"k", np.zeros(4, dtype=np.int32))  # type: ignore[arg-type]
    with pytest.raises(TierError, match="uint8"):
        tier.get_into(b"k", np.zeros(4, dtype=np.int32))  # type: ignore[arg-type]
    assert tier.get_into(b"missing", np.empty(100, dtype=np.uint8)) is False  # a miss, no error
    stats = tier.stats()
    assert (stats.store_failures, stats.stores) == (4, 0)
    assert (stats.misses, stats.load_failures, stats.loads) == (1, 1, 0)
    assert [p.suffix for p in tier.directory.iterdir()] == [".owner"]  # no chunk, no temp file


def test_flipped_payload_byte_is_corrupt_and_dropped(tier: DiskTier) -> None:
    a, b = key_of(1), key_of(2)
    tier.put(a, payload(a, 10_000))
    tier.put(b, payload(b, 10_000))
    with chunk_file(tier, a).open("r+b") as f:
        f.seek(ALIGN + 1234)
        byte = f.read(1)
        f.seek(ALIGN + 1234)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptChunkError, match="checksum"):
        load(tier, a, 10_000)
    assert not holds(tier, a) and not chunk_file(tier, a).exists()
    stats = tier.stats()
    assert (stats.corrupt, stats.load_failures, stats.evictions, stats.chunks) == (1, 0, 0, 1)
    assert np.array_equal(load(tier, b, 10_000), payload(b, 10_000))  # keeps serving
    tier.put(a, payload(a, 10_000))
    assert np.array_equal(load(tier, a, 10_000), payload(a, 10_000))
    tier.check_integrity()


@pytest.mark.parametrize("offset", [0, 20, 40], ids=["magic", "namespace", "checksum"])
def test_damaged_header_is_corrupt(tier: DiskTier, offset: int) -> None:
    key = key_of(7)
    tier.put(key, payload(key, 5000))
    with chunk_file(tier, key).open("r+b") as f:
        f.seek(offset)
        f.write(b"\xaa")
    with pytest.raises(CorruptChunkError):
        load(tier, key, 5000)
    assert not holds(tier, key) and tier.stats().corrupt == 1
    tier.check_integrity()


@pytest.mark.parametrize("keep", [100, ALIGN + 10], ids=["in-header", "in-payload"])
def test_truncated_file_is_corrupt(tier: DiskTier, keep: int) -> None:
    key = key_of(3)
    tier.put(key, payload(key, 3 * ALIGN))
    os.truncate(chunk_file(tier, key), keep)
    with pytest.raises(CorruptChunkError, match="truncated"):
        load(tier, key, 3 * ALIGN)
    assert not holds(tier, key) and tier.stats().corrupt == 1


def test_wrong_size_fails_but_keeps_the_chunk(tier: DiskTier) -> None:
    key = key_of(4)
    tier.put(key, payload(key, 9000))
    with pytest.raises(TierError, match="9000") as info:
        load(tier, key, 8000)
    assert not isinstance(info.value, CorruptChunkError)
    assert np.array_equal(load(tier, key, 9000), payload(key, 9000))
    stats = tier.stats()
    assert (stats.load_failures, stats.corrupt, stats.loads) == (1, 0, 1)


def test_vanished_file_is_a_miss_and_forgotten(tier: DiskTier) -> None:
    key = key_of(5)
    tier.put(key, payload(key, 100))
    chunk_file(tier, key).unlink()  # another process, or an operator, removed it
    assert tier.get_into(key, np.empty(100, dtype=np.uint8)) is False
    assert not holds(tier, key)
    stats = tier.stats()
    assert (stats.misses, stats.load_failures, stats.chunks, stats.used_bytes) == (1, 0, 0, 0)
    tier.check_integrity()


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    n = 3 * ALIGN
    tier = DiskTier(tmp_path, 3 * file_bytes(n), NS)
    for i in range(3):
        tier.put(key_of(i), payload(key_of(i), n))
    load(tier, key_of(0), n)  # 0 is now the most recently used
    tier.put(key_of(3), payload(key_of(3), n))
    tier.put(key_of(4), payload(key_of(4), n))
    assert [holds(tier, key_of(i)) for i in range(5)] == [True, False, False, True, True]
    assert lru_keys(tier) == [key_of(0), key_of(3), key_of(4)]
    assert not chunk_file(tier, key_of(1)).exists() and not chunk_file(tier, key_of(2)).exists()
    stats = tier.stats()
    assert stats.evictions == 2 and stats.evicted_bytes == 2 * file_bytes(n)
    assert stats.used_bytes == 3 * file_bytes(n) == stats.capacity_bytes
    # A key names its bytes: storing a chunk the tier holds writes nothing and evicts nothing
    # (a rewrite would reserve a whole file first, evicting another chunk at full budget).
    # It counts as a store and a use: 3 is now more recent than 4, so 0 goes next.
    tier.put(key_of(3), payload(key_of(3), n))
    stats = tier.stats()
    assert (stats.stores, stats.evictions, stats.counters["already_held"]) == (6, 2, 1)
    tier.put(key_of(5), payload(key_of(5), n))
    assert tier.stats().evictions == 3 and lru_keys(tier) == [key_of(4), key_of(3), key_of(5)]
    assert np.array_equal(load(tier, key_of(3), n), payload(key_of(3), n))
    tier.check_integrity()


def test_chunk_bigger_than_the_budget_fails(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 64 * 1024, NS)
    tier.put(key_of(1), payload(key_of(1), 1000))
    with pytest.raises(TierError, match="disk_bytes_to_use"):
        tier.put(key_of(2), payload(key_of(2), 64 * 1024))
    stats = tier.stats()
    assert (stats.store_failures, stats.stores, stats.evictions) == (1, 1, 0)
    assert lru_keys(tier) == [key_of(1)]
    assert chunk_names(tier.directory) == [f"{key_of(1).hex()}.kv"]
    assert not list(tier.directory.glob("*.tmp"))


def _deny_writes(directory: Path) -> str | None:
    """Make ``directory`` refuse new files for this process; return the undo, or None."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        return "chmod"
    # root ignores mode bits; the immutable attribute stops even root from creating files
    chattr = shutil.which("chattr")
    if (
        chattr
        and subprocess.run(
            [chattr, "+i", str(directory)], check=False, capture_output=True
        ).returncode
        == 0
    ):
        return "chattr"
    return None


def test_unwritable_directory_fails_stores_and_keeps_serving(tier: DiskTier) -> None:
    key = key_of(1)
    tier.put(key, payload(key, 5000))
    undo = _deny_writes(tier.directory)
    if undo is None:
        pytest.skip("running as root without chattr/CAP_LINUX_IMMUTABLE: writes cannot be denied")
    try:
        with pytest.raises(TierError, match="failed") as info:
            tier.put(key_of(2), payload(key_of(2), 5000))
        assert not isinstance(info.value, OSError)  # a verdict, not a syscall error
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno in (errno.EACCES, errno.EPERM)
        assert np.array_equal(load(tier, key, 5000), payload(key, 5000))
        assert tier.stats().store_failures == 1 and not holds(tier, key_of(2))
    finally:
        if undo == "chmod":
            tier.directory.chmod(0o700)
        else:
            subprocess.run(["chattr", "-i", str(tier.directory)], check=True)
    tier.put(key_of(2), payload(key_of(2), 5000))
    assert np.array_equal(load(tier, key_of(2), 5000), payload(key_of(2), 5000))
    tier.check_integrity()


def test_concurrent_puts_and_gets(tmp_path: Path) -> None:
    n, threads, per_thread = 70_000, 6, 12
    tier = DiskTier(tmp_path, 1 << 30, NS)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for j in range(per_thread):
                key = key_of(t * 1000 + j)
                tier.put(key, payload(key, n))
                mine = load(tier, key, n)
                assert np.array_equal(mine, payload(key, n))
                other = key_of(((t + 1) % threads) * 1000 + j // 2)
                if holds(tier, other):
                    assert np.array_equal(load(tier, other, n), payload(other, n))
                tier.put(key_of(999_999), payload(key_of(t), n))  # one key, many writers
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert errors == []
    assert len(lru_keys(tier)) == threads * per_thread + 1
    shared = load(tier, key_of(999_999), n)
    assert any(np.array_equal(shared, payload(key_of(t), n)) for t in range(threads))
    tier.check_integrity()


CRASH_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvoffload.tiers.disk import DiskTier

    tier = DiskTier(sys.argv[1], 256 << 20, bytes.fromhex(sys.argv[2]))
    i = 0
    while True:
        key = i.to_bytes(16, "little")
        data = np.random.default_rng(i).bytes((4 << 20) + 4096 * (i % 3) + i % 5)
        tier.put(key, np.frombuffer(data, np.uint8))
        print(i, flush=True)
        i += 1
    """
)


def crash_size(i: int) -> int:
    return (4 << 20) + 4096 * (i % 3) + i % 5


def test_sigkill_mid_write_leaves_nothing_half_written(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_WRITER, str(tmp_path), NS.hex()],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    try:
        for _ in range(3):  # a few chunks committed before the kill
            assert proc.stdout.readline()
        ns_dir = tmp_path / NS.hex()
        for _ in range(20_000):  # kill the moment a temp file (a write in progress) shows up
            if any(name.endswith(".tmp") for name in os.listdir(ns_dir)):
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    left = [p for p in ns_dir.iterdir() if p.suffix == ".tmp"]  # usually the killed write
    stale = ns_dir / f"{key_of(10**6).hex()}.00112233.tmp"  # an older version's: no owner
    stale.write_bytes(b"half a chunk")
    old = time.time() - STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    recent = ns_dir / f"{key_of(10**6 + 1).hex()}.44556677.tmp"  # its writer may be alive
    recent.write_bytes(b"half a chunk")
    tier = DiskTier(tmp_path, 256 << 20, NS)
    assert [p.name for p in ns_dir.iterdir() if p.suffix == ".tmp"] == [recent.name]
    assert tier.stats().counters["temp_files_cleaned"] == len(left) + 1
    assert reservations(tmp_path) == []  # the killed store's reservation is released
    assert len(list(ns_dir.glob("*.owner"))) == 1  # the new tier's; the dead one's is gone
    keys = lru_keys(tier)
    assert len(keys) >= 3
    for key in keys:
        i = int.from_bytes(key, "little")
        expected = np.frombuffer(np.random.default_rng(i).bytes(crash_size(i)), np.uint8)
        assert np.array_equal(load(tier, key, crash_size(i)), expected)
    assert tier.stats().corrupt == 0
    tier.check_integrity()


def test_warm_restart_keeps_the_lru_order(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 1 << 20, NS)
    for i in range(3):
        first.put(key_of(i), payload(key_of(i), 3000 + i))
    load(first, key_of(1), 3001)
    load(first, key_of(0), 3000)  # now 2 is the oldest, then 1, then 0
    first.close()
    with pytest.raises(TierError, match="closed"):
        first.put(key_of(9), payload(key_of(9), 10))
    first.close()  # idempotent
    second = TIERS.create("disk", str(tmp_path), 1 << 20, NS)
    assert isinstance(second, DiskTier)
    assert lru_keys(second) == [key_of(2), key_of(1), key_of(0)]
    for i in range(3):
        assert np.array_equal(load(second, key_of(i), 3000 + i), payload(key_of(i), 3000 + i))
    second.check_integrity()
    other = DiskTier(tmp_path, 1 << 20, b"\x02" * 16)
    assert lru_keys(other) == [] and not holds(other, key_of(0))
    assert other.directory != second.directory


def test_chunk_files_without_an_index_are_indexed_in_mtime_order(tmp_path: Path) -> None:
    """An index removed (or a directory from a version without one): the files are adopted."""
    first = DiskTier(tmp_path, 1 << 20, NS)
    for i in range(3):
        first.put(key_of(i), payload(key_of(i), 3000 + i))
    first.close()
    for path in tmp_path.glob("kvoffload-index.sqlite3*"):
        path.unlink()
    for age, i in enumerate((1, 2, 0)):  # make 1 the oldest, then 2, then 0
        os.utime(tmp_path / NS.hex() / f"{key_of(i).hex()}.kv", ns=(10**18, 10**18 + age))
    second = DiskTier(tmp_path, 1 << 20, NS)
    assert lru_keys(second) == [key_of(1), key_of(2), key_of(0)]
    assert second.stats().used_bytes == sum(file_bytes(3000 + i) for i in range(3))
    for i in range(3):
        assert np.array_equal(load(second, key_of(i), 3000 + i), payload(key_of(i), 3000 + i))
    second.check_integrity()


def test_restart_with_a_smaller_budget_evicts_the_oldest(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 1 << 20, NS)
    for i in range(4):
        first.put(key_of(i), payload(key_of(i), 5000))
    smaller = DiskTier(tmp_path, 2 * file_bytes(5000), NS)
    assert lru_keys(smaller) == [key_of(2), key_of(3)]
    assert not chunk_file(first, key_of(0)).exists() and not chunk_file(first, key_of(1)).exists()
    assert smaller.stats().evictions == 2
    smaller.check_integrity()


def test_integrity_check_reports_a_missing_file(tier: DiskTier) -> None:
    tier.put(key_of(1), payload(key_of(1), 10))
    tier.check_integrity()
    chunk_file(tier, key_of(1)).unlink()
    with pytest.raises(IntegrityError, match="1 entries"):
        tier.check_integrity()


def test_discard(tier: DiskTier) -> None:
    tier.put(key_of(1), payload(key_of(1), 10))
    tier.discard(key_of(1))
    tier.discard(key_of(2))
    assert lru_keys(tier) == [] and not chunk_file(tier, key_of(1)).exists()
    stats = tier.stats()
    assert (stats.used_bytes, stats.chunks, stats.evictions) == (0, 0, 0)
    tier.check_integrity()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("", 1 << 20, NS), "disk_path"),
        ((".", 0, NS), "disk_bytes_to_use"),
        ((".", True, NS), "disk_bytes_to_use"),
        ((".", 1.5, NS), "disk_bytes_to_use"),
        ((".", 1 << 20, b""), "namespace"),
        ((".", 1 << 20, "ns"), "namespace"),
    ],
)
def test_bad_configuration(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DiskTier(*args)  # type: ignore[arg-type]


def test_disk_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="disk_path"):
        DiskTier(tmp_path / "file", 1 << 20, NS)
    with pytest.raises(ConfigError, match="disk_path"):
        DiskTier(tmp_path / "file" / "below", 1 << 20, NS)
