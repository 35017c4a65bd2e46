"""CPU + disk as a cascade: write-through, promotion from disk, corrupt and failing disks.

Real ``DiskTier`` files in ``tmp_path``; the index is the real ``OffloadIndex``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _paths import as_bytes

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.engine import ChunkSpan, JobResult, JobStatus, OffloadEngine
from kvoffload.errors import ConfigError
from kvoffload.manager.index import OffloadIndex
from kvoffload.messages import BlockSpan
from kvoffload.tiers.cascade import TierCascade
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.disk import DiskTier
from kvoffload.transfer import KVTransfer, allocate_kv_caches, fill_blocks

NUM_BLOCKS = 32
BPC = 2
NAMESPACE = b"test-cascade-ns!"
LAYOUT = KVLayout(
    (
        CacheGroup("sliding", 16, ("s0", "s1"), 2 * 16 * 32 * 2, sliding_window=32),
        CacheGroup("full", 4, ("f0",), 2 * 4 * 64 * 2),
    )
)
SLOT_BYTES = max(g.chunk_bytes(BPC) for g in LAYOUT.groups)


@pytest.fixture
def kv() -> dict[str, torch.Tensor]:
    caches = allocate_kv_caches(LAYOUT, NUM_BLOCKS, torch.bfloat16)
    fill_blocks(caches, seed=21)
    return caches


def make_engine(
    kv: dict[str, torch.Tensor], path: Path, slots: int = 4, disk_bytes: int = 1 << 24
) -> OffloadEngine:
    cpu = CPUSlab(slots, SLOT_BYTES, pin_memory=False)
    disk = DiskTier(path, disk_bytes, NAMESPACE)
    return OffloadEngine.create(KVTransfer(LAYOUT, kv, BPC), cpu, [disk])


@pytest.fixture
def engine(kv: dict[str, torch.Tensor], tmp_path: Path) -> Iterator[OffloadEngine]:
    eng = make_engine(kv, tmp_path)
    yield eng
    eng.close()


def one(engine: OffloadEngine) -> JobResult:
    assert engine.wait(timeout=60)
    [result] = engine.get_finished()
    return result


def disk_of(engine: OffloadEngine) -> DiskTier:
    [disk] = engine.cascade.lower
    assert isinstance(disk, DiskTier)
    return disk


def test_store_writes_through_to_disk_before_it_is_reported(engine: OffloadEngine) -> None:
    engine.submit_store([ChunkSpan(0, (b"a", b"b"), (0, 1), BlockSpan((0, 1, 2, 3)))])
    result = one(engine)
    assert result.status is JobStatus.SUCCESS and result.errors == ()
    disk = disk_of(engine)
    assert disk.contains_many([b"a", b"b"]) == [True, True]
    assert engine.cascade.cpu.holds(b"a", 0)
    stats = engine.stats()
    assert stats["disk"].stores == stats["cpu"].stores == 2
    assert stats["disk"].store_bytes == 2 * LAYOUT.groups[0].chunk_bytes(BPC)
    assert stats["disk"].store_bytes == stats["cpu"].store_bytes  # counted once by each tier
    engine.cascade.check_integrity()


def test_a_chunk_evicted_from_cpu_is_promoted_back_from_disk(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    original = as_bytes(kv["f0"][[6, 7]]).clone()
    engine.submit_store([ChunkSpan(1, (b"f",), (2,), BlockSpan((6, 7)))])
    one(engine)
    engine.submit_store([ChunkSpan(1, (b"other",), (2,), BlockSpan((8, 9)))])  # reuses slot 2
    one(engine)
    assert not engine.cascade.cpu.holds(b"f", 2)
    engine.submit_load([ChunkSpan(1, (b"f",), (3,), BlockSpan((20, 21)))])
    result = one(engine)
    assert result.status is JobStatus.SUCCESS and result.promoted_keys == (b"f",)
    assert torch.equal(as_bytes(kv["f0"][[20, 21]]), original)
    assert engine.cascade.cpu.holds(b"f", 3)  # promoted: the next load is a CPU hit
    engine.submit_load([ChunkSpan(1, (b"f",), (3,), BlockSpan((22, 23)))])
    assert one(engine).promoted_keys == ()
    stats = engine.stats()
    assert (stats["disk"].loads, stats["disk"].misses) == (1, 0)
    assert (stats["cpu"].misses, stats["cpu"].loads) == (1, 2)  # one promotion, two scatters
    engine.cascade.check_integrity()


def test_corrupt_disk_chunk_is_reported_by_block_and_never_scattered(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    engine.submit_store([ChunkSpan(1, (b"f",), (0,), BlockSpan((6, 7)))])
    one(engine)
    engine.cascade.cpu.release(0)  # gone from CPU: only the disk copy remains
    [path] = disk_of(engine).directory.glob("*.kv")
    raw = bytearray(path.read_bytes())
    raw[4096 + 10] ^= 0xFF  # inside the payload, after the 4 KiB header
    path.write_bytes(bytes(raw))
    before = as_bytes(kv["f0"][[20, 21]]).clone()
    engine.submit_load([ChunkSpan(1, (b"f",), (1,), BlockSpan((20, 21)))])
    result = one(engine)
    assert result.status is JobStatus.FAILED
    assert dict(result.failed_blocks) == {1: (20, 21)}
    [error] = result.errors  # names the chunk, the tier and what was wrong
    assert error.startswith(f"no tier could load chunk {b'f'.hex()} (disk: ")
    assert "checksum" in error
    assert torch.equal(as_bytes(kv["f0"][[20, 21]]), before)
    assert disk_of(engine).contains_many([b"f"]) == [False]  # dropped by the disk tier
    disk = engine.stats()["disk"]
    assert (disk.corrupt, disk.load_failures, disk.loads) == (1, 0, 0)
    engine.cascade.check_integrity()


def test_failed_disk_write_is_reported_without_failing_the_store(
    kv: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    engine = make_engine(kv, tmp_path, disk_bytes=4096)  # too small for any chunk
    try:
        engine.submit_store([ChunkSpan(0, (b"a",), (0,), BlockSpan((0, 1)))])
        result = one(engine)
        assert result.status is JobStatus.SUCCESS  # it is loadable from CPU
        assert len(result.errors) == 1 and result.errors[0].startswith("disk:")
        stats = engine.stats()
        assert (stats["disk"].store_failures, stats["disk"].stores) == (1, 0)
        assert stats["cpu"].stores == 1
    finally:
        engine.close()


def test_warm_restart_serves_chunks_from_disk(kv: dict[str, torch.Tensor], tmp_path: Path) -> None:
    original = as_bytes(kv["s1"][[4, 5]]).clone()
    first = make_engine(kv, tmp_path)
    first.submit_store([ChunkSpan(0, (b"w",), (0,), BlockSpan((4, 5)))])
    one(first)
    first.close()
    second = make_engine(kv, tmp_path)  # a new process: empty CPU tier
    try:
        second.submit_load([ChunkSpan(0, (b"w",), (0,), BlockSpan((10, 11)))])
        result = one(second)
        assert result.promoted_keys == (b"w",)
        assert torch.equal(as_bytes(kv["s1"][[10, 11]]), original)
    finally:
        second.close()


def test_index_engine_and_cascade_together(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    """The scheduler-side protocol: evictions from the index fall back to disk hits."""
    index = OffloadIndex(engine.cascade.cpu.num_slots)
    keys = [bytes([i]) * 4 for i in range(6)]
    blocks = {k: (2 * i, 2 * i + 1) for i, k in enumerate(keys)}
    snapshot = {k: as_bytes(kv["f0"][list(b)]).clone() for k, b in blocks.items()}
    for key in keys:  # six stores into four slots: the first two are evicted
        store = index.prepare_store([key])
        assert store is not None
        engine.submit_store([ChunkSpan(1, store.keys, store.slots, BlockSpan(blocks[key]))])
        if one(engine).status is JobStatus.SUCCESS:
            index.complete_store(store.keys)
        else:
            index.abort_store(store.keys)
    assert index.lookup(keys[:1]) == 0 and disk_of(engine).contains_many(keys[:1]) == [True]
    promote = index.prepare_store(keys[:1])  # a disk hit: reserve its CPU slot
    assert promote is not None
    engine.submit_load([ChunkSpan(1, promote.keys, promote.slots, BlockSpan((30, 31)))])
    result = one(engine)
    index.complete_store(result.promoted_keys)
    assert index.lookup(keys[:1]) == 1
    assert torch.equal(as_bytes(kv["f0"][[30, 31]]), snapshot[keys[0]])
    loaded = index.prepare_load([keys[5]])  # a CPU hit
    engine.submit_load([ChunkSpan(1, loaded.keys, loaded.slots, BlockSpan((28, 29)))])
    assert one(engine).promoted_keys == ()
    index.complete_load(loaded.keys)
    assert torch.equal(as_bytes(kv["f0"][[28, 29]]), snapshot[keys[5]])
    index.check_integrity()
    engine.cascade.check_integrity()


def test_a_cascade_rejects_tiers_whose_stats_would_merge(tmp_path: Path) -> None:
    cpu = CPUSlab(2, SLOT_BYTES, pin_memory=False)
    first = DiskTier(tmp_path / "a", 1 << 20, b"ns")
    second = DiskTier(tmp_path / "b", 1 << 20, b"ns")
    expected = r"needs its own non-empty name, got \['cpu', 'disk', 'disk'\]"
    with pytest.raises(ConfigError, match=expected):
        TierCascade(cpu, [first, second])
    assert list(TierCascade(cpu, [first]).stats()) == ["cpu", "disk"]
