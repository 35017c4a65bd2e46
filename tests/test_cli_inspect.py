"""``kvoffload inspect``: a disk tier read beside its running owner, and nothing changed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from _cli import assert_one_line, kvoffload, kvoffload_all

from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.disk.inspect import inspect_disk

NS = b"kvoffload-inspect-test"
CHUNK = 8192


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``root``: its size and mtime, so any change shows.

    SQLite's ``-shm`` is shared memory, not data: a WAL reader marks its read
    there, so only its size counts.
    """
    return {
        str(path.relative_to(root)): (
            path.lstat().st_size,
            0 if path.name.endswith("-shm") else path.lstat().st_mtime_ns,
        )
        for path in root.rglob("*")
    }


def _store(tier: DiskTier, count: int) -> list[bytes]:
    keys = [i.to_bytes(8, "big") for i in range(count)]
    for i, key in enumerate(keys):
        tier.put(key, np.full(CHUNK, i, dtype=np.uint8))
    return keys


def test_inspect_beside_a_running_tier_reads_and_changes_nothing(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, NS)
    try:
        _store(tier, 5)
        before = _snapshot(tmp_path)
        table, as_json = kvoffload_all([["inspect", tmp_path], ["inspect", tmp_path, "--json"]])
        assert _snapshot(tmp_path) == before  # nothing created, repaired or deleted
        tier.put(b"after", np.zeros(CHUNK, dtype=np.uint8))  # the owner still writes
    finally:
        tier.close()
    assert table.code == 0 and table.err == "" and "5 chunks" in table.out
    report = json.loads(as_json.out)
    assert report["schema"] == 1 and report["chunks"] == 5 and report["damaged"] == 0
    (ns,) = report["namespaces"]
    assert ns["indexed"] == ns["files"] == 5 and ns["oldest_use_ns"] <= ns["newest_use_ns"]
    assert report["free_bytes"] > 0 and report["used_bytes"] == ns["indexed_bytes"]


def test_inspect_of_a_closed_cache_creates_no_sqlite_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, NS)
    _store(tier, 2)
    tier.close()
    before = _snapshot(tmp_path)
    assert inspect_disk(tmp_path).chunks == 2
    assert _snapshot(tmp_path) == before


def test_inspect_finds_damaged_files_and_exits_1(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, NS)
    try:
        keys = _store(tier, 3)
    finally:
        tier.close()
    (directory,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    header, payload = (directory / f"{keys[0].hex()}.kv", directory / f"{keys[1].hex()}.kv")
    with header.open("r+b") as fh:
        fh.seek(20)
        fh.write(b"XX")
    with payload.open("r+b") as fh:
        fh.seek(5000)
        fh.write(b"XX")
    os.mkfifo(directory / "ff.kv")
    quick, verified = kvoffload_all([["inspect", tmp_path], ["inspect", tmp_path, "--verify",
                                                             "--json"]])  # fmt: skip
    assert quick.code == 1 and "header checksum mismatch" in quick.out
    assert "ff.kv: not a regular file" in quick.out
    damaged = json.loads(verified.out)["namespaces"][0]["damaged"]
    assert verified.code == 1 and len(damaged) == 3
    assert any("payload checksum mismatch" in entry for entry in damaged)


def test_inspect_of_no_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    missing, a_file = kvoffload_all(
        [["inspect", tmp_path / "none"], ["inspect", tmp_path / "file"]]
    )
    assert_one_line(missing, "cannot be read: No such file or directory")
    assert_one_line(a_file, "is not a directory")
    assert not (tmp_path / "none").exists()


def test_inspect_of_an_empty_directory_says_so(tmp_path: Path) -> None:
    ran = kvoffload("inspect", tmp_path)
    assert ran.code == 0 and "no index" in ran.out and "nothing stored yet" in ran.out
    assert list(tmp_path.iterdir()) == []
