"""A ``disk_path`` the serving process may not write, on real parts: a read-only mount, an
immutable directory, and a child process of another user (uid 65534) on a 0500 directory.
Each holds chunks another process stored; each is served, its stores skipped and counted."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _disk import files_under, mounted, remount_read_only, tmpfs, unavailable
from _redis_servers import RedisServer

from kvoffload import ConfigError, CorruptChunkError
from kvoffload.tiers.cascade import TierCascade
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.remote import RedisTier

REPO = Path(__file__).resolve().parents[1]
NS = b"\x05" * 16
N = 30_000
BUDGET = 64 << 20
KEYS = [i.to_bytes(16, "little") for i in range(4)]
NEW = (99).to_bytes(16, "little")


def payload(key: bytes) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(int.from_bytes(key, "little")).bytes(N), np.uint8)


def fill(root: Path) -> None:
    """What a writer left: KEYS stored under ``root``, the tier closed."""
    tier = DiskTier(root, BUDGET, NS)
    for key in KEYS:
        tier.put(key, payload(key))
    tier.close()


def serve(root: Path) -> dict[str, object]:
    """Open a tier on ``root``, load every chunk, store one more; what it saw (as JSON)."""
    tier = DiskTier(root, BUDGET, NS)
    out = np.empty(N, np.uint8)
    exact = [tier.get_into(key, out) and np.array_equal(out, payload(key)) for key in KEYS]
    tier.put(NEW, payload(NEW))
    stats = tier.stats()
    seen = {
        "read_only": tier.read_only,
        "exact": exact,
        "found": tier.contains_many([*KEYS, NEW]),
        "loads": stats.loads,
        "stores": stats.stores,
        "store_failures": stats.store_failures,
        "chunks": stats.chunks,
        "skips": stats.counters["read_only_skips"],
        "gauge": stats.gauges["read_only"],
    }
    tier.close()
    return seen


SERVED = {
    "read_only": True,
    "exact": [True] * len(KEYS),
    "found": [True] * len(KEYS) + [False],
    "loads": len(KEYS),
    "stores": 0,
    "store_failures": 0,
    "chunks": len(KEYS),
    "skips": 1,
    "gauge": 1,
}


def assert_served_read_only(root: Path, cause: str, caplog: pytest.LogCaptureFixture) -> None:
    """Served, nothing under ``root`` changed, and one warning naming disk_path and ``cause``."""
    before = files_under(root)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert serve(root) == SERVED
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"disk_path {str(root)!r} is read-only ({cause})" in warning
    assert f"serving its {len(KEYS)} chunks" in warning and "read_only_skips" in warning
    assert files_under(root) == before


# -- a read-only mount -----------------------------------------------------------------------


@pytest.fixture
def ro_mount(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs, mounted read-only once the test has filled it (``remount_read_only``)."""
    with tmpfs(tmp_path / "ro", "16m") as mnt:
        yield mnt


def test_a_read_only_mount_is_served(ro_mount: Path, caplog: pytest.LogCaptureFixture) -> None:
    fill(ro_mount)
    remount_read_only(ro_mount)
    assert_served_read_only(ro_mount, "it is on a read-only mount", caplog)


def test_a_read_only_mount_with_nothing_to_serve_is_refused(ro_mount: Path) -> None:
    DiskTier(ro_mount, BUDGET, b"\x06" * 16).close()  # another model's chunks only
    remount_read_only(ro_mount)
    with pytest.raises(ConfigError) as info:
        DiskTier(ro_mount, BUDGET, NS)
    assert str(info.value) == (
        f"disk_path {str(ro_mount)!r} is read-only (it is on a read-only mount) and holds no "
        "chunks of this model to serve; make it writable, or point disk_path at a writable "
        "directory"
    )
    with pytest.raises(ConfigError, match=r"disk_path .* is read-only \(it is on a read-only"):
        DiskTier(ro_mount / "below", BUDGET, NS)  # a disk_path it would have to create


def test_a_corrupt_chunk_on_a_read_only_mount_fails_each_load_and_stays(ro_mount: Path) -> None:
    fill(ro_mount)
    damaged = ro_mount / NS.hex() / f"{KEYS[0].hex()}.kv"
    data = bytearray(damaged.read_bytes())
    data[4096 + N // 2] ^= 0xFF  # a payload byte (after the 4 KiB header)
    damaged.write_bytes(bytes(data))
    remount_read_only(ro_mount)
    tier = DiskTier(ro_mount, BUDGET, NS)
    try:
        for _ in range(2):  # it cannot be dropped: each load fails, the engine recomputes
            with pytest.raises(CorruptChunkError):
                tier.get_into(KEYS[0], np.empty(N, np.uint8))
        assert damaged.exists() and tier.stats().corrupt == 2
        assert tier.get_into(KEYS[1], out := np.empty(N, np.uint8))
        assert np.array_equal(out, payload(KEYS[1]))
    finally:
        tier.close()


def test_a_store_that_skips_a_read_only_disk_still_reaches_the_remote_tier(
    ro_mount: Path, redis_server: RedisServer
) -> None:
    fill(ro_mount)
    remount_read_only(ro_mount)
    disk, remote = DiskTier(ro_mount, BUDGET, NS), RedisTier(redis_server.url, NS)
    cascade = TierCascade(CPUSlab(2, N, pin_memory=False), [disk, remote])
    try:
        cascade.cpu.slot_array(0, N)[:] = payload(NEW)
        assert cascade.write_through(NEW, 0, N) == []
        assert remote.contains_many([NEW]) == [True] and disk.contains_many([NEW]) == [False]
        stats = cascade.stats()
        assert stats["disk"].counters["read_only_skips"] == 1 and stats["redis"].stores == 1
        assert cascade.fill(KEYS[0], 1, N) is disk  # and loads still come from the disk
        assert np.array_equal(cascade.cpu.slot_array(1, N), payload(KEYS[0]))
    finally:
        cascade.close()


# -- an immutable directory ------------------------------------------------------------------


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Path]:
    """A directory on a file system with the immutable attribute: ``tmp_path`` if it has
    one, else a small ext4 image on a loop device (as CI runs it)."""
    if shutil.which("chattr") is None or shutil.which("mkfs.ext4") is None:
        unavailable("chattr or mkfs.ext4 is missing: apt-get install -y e2fsprogs")
    probe = tmp_path / "probe"
    probe.mkdir()
    if (
        subprocess.run(["chattr", "+i", str(probe)], check=False, capture_output=True).returncode
        == 0
    ):
        subprocess.run(["chattr", "-i", str(probe)], check=True)
        yield tmp_path / "imm"
        return
    image = tmp_path / "ext4.img"
    with image.open("wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True, capture_output=True)
    with mounted(tmp_path / "ext4", ["-o", "loop", str(image)], "an ext4 image") as mnt:
        yield mnt / "imm"


def test_an_immutable_directory_is_served(ext4: Path, caplog: pytest.LogCaptureFixture) -> None:
    fill(ext4)
    subprocess.run(["chattr", "-R", "+i", str(ext4)], check=True)
    try:
        assert_served_read_only(ext4, "it is immutable (chattr +i)", caplog)
        with pytest.raises(ConfigError, match=r"is read-only \(it is immutable \(chattr \+i\)\)"):
            DiskTier(ext4, BUDGET, b"\x06" * 16)  # no chunks of this model
    finally:
        subprocess.run(["chattr", "-R", "-i", str(ext4)], check=True)


# -- a directory of the serving user, mode 0500 ----------------------------------------------

#: Imports as root (the interpreter lives under root's 0700 home here), then serves as uid
#: and gid 65534: every file call of the tier runs as that user.
CHILD = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from test_disk_readonly import serve
from kvoffload import ConfigError, CorruptChunkError
from pathlib import Path
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
try:
    print(json.dumps(serve(Path(sys.argv[2]))))
except ConfigError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def as_nobody(root: Path) -> dict[str, object]:
    """``serve(root)`` in a child process running as uid and gid 65534."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO / "tests"), str(root)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A directory uid 65534 can reach (pytest's own are root's, 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a child as another user")
    base = Path(tempfile.mkdtemp(prefix="kvoffload-nobody-"))
    base.chmod(0o755)
    try:
        yield base / "disk"
    finally:
        shutil.rmtree(base)


def hand_to_nobody(root: Path) -> None:
    """Everything under ``root`` owned by 65534, every directory 0500."""
    for path in [root, *root.rglob("*")]:
        os.chown(path, 65534, 65534, follow_symlinks=False)
        if path.is_dir():
            path.chmod(0o500)


def test_a_directory_the_serving_user_cannot_write_is_served(nobody_dir: Path) -> None:
    fill(nobody_dir)
    hand_to_nobody(nobody_dir)
    before = files_under(nobody_dir)
    assert as_nobody(nobody_dir) == SERVED
    assert files_under(nobody_dir) == before


def test_a_directory_the_serving_user_cannot_write_with_nothing_to_serve(
    nobody_dir: Path,
) -> None:
    DiskTier(nobody_dir, BUDGET, b"\x06" * 16).close()
    hand_to_nobody(nobody_dir)
    seen = as_nobody(nobody_dir)
    assert seen == {"error": (
        f"disk_path {str(nobody_dir)!r} is read-only (user 65534 may not write it (mode 0500, "
        "owner 65534)) and holds no chunks of this model to serve; make it writable, or point "
        "disk_path at a writable directory"
    )}  # fmt: skip
