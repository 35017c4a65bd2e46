"""The offload engine: async jobs, verified loads, reported failures, no races per chunk.

The engine's tests run on every transfer path (``tests/_paths.py``), CUDA
tensors with pinned slabs included where a GPU is present.
"""

from __future__ import annotations

import ast
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from _paths import PATHS, TransferPath, as_bytes

import kvoffload.engine
from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.engine import ChunkSpan, JobKind, JobResult, JobStatus, LayeredLoad, OffloadEngine
from kvoffload.engine._locks import Held, JobLocks
from kvoffload.errors import TransferError
from kvoffload.messages import BlockSpan
from kvoffload.tiers.base import ChunkBuffer, WrappedTier
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.stats import TierStats
from kvoffload.transfer import allocate_kv_caches, fill_blocks

NUM_BLOCKS = 32
BPC = 2


def layout() -> KVLayout:
    return KVLayout(
        (
            CacheGroup("sliding", 8, ("s0", "s1"), 2 * 8 * 4 * 2, sliding_window=16),
            CacheGroup("full", 2, ("f0",), 2 * 2 * 16 * 2),
        )
    )


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> TransferPath:
    param: TransferPath = request.param
    return param


@pytest.fixture
def kv(path: TransferPath) -> dict[str, torch.Tensor]:
    caches = allocate_kv_caches(layout(), NUM_BLOCKS, torch.bfloat16, device=path.device)
    fill_blocks(caches, seed=11)
    return caches


def slab(path: TransferPath, num_slots: int, slot_bytes: int) -> CPUSlab:
    return CPUSlab(num_slots, slot_bytes, pin_memory=path.device == "cuda")


@pytest.fixture
def engine(path: TransferPath, kv: dict[str, torch.Tensor]) -> Iterator[OffloadEngine]:
    lay = layout()
    transfer = path.transfer(lay, kv, BPC)
    eng = OffloadEngine.create(
        transfer, slab(path, 16, max(g.chunk_bytes(BPC) for g in lay.groups))
    )
    yield eng
    eng.close()


def finish(engine: OffloadEngine) -> list[JobResult]:
    assert engine.wait(timeout=60)
    return engine.get_finished()


def test_store_then_load_round_trips_every_group(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    original = {n: t.clone() for n, t in kv.items()}
    spans = [
        ChunkSpan(0, (b"s-a", b"s-b"), (0, 1), BlockSpan((4, 5, 9, 2))),
        ChunkSpan(1, (b"f-a",), (2,), BlockSpan((7, 3))),
    ]
    store = engine.submit_store(spans)
    [stored] = finish(engine)
    assert (stored.job_id, stored.kind, stored.status) == (store, JobKind.STORE, JobStatus.SUCCESS)
    assert stored.done_keys == (b"s-a", b"s-b", b"f-a")
    assert engine.get_finished() == []  # reported once
    for t in kv.values():
        t.zero_()
    # Load into other blocks, the sliding group starting inside its first chunk.
    load = engine.submit_load(
        [
            ChunkSpan(0, (b"s-a", b"s-b"), (0, 1), BlockSpan((20, 21, 22), first_offset=1)),
            ChunkSpan(1, (b"f-a",), (2,), BlockSpan((10, 11))),
        ]
    )
    [loaded] = finish(engine)
    assert (loaded.job_id, loaded.status, dict(loaded.failed_blocks)) == (
        load,
        JobStatus.SUCCESS,
        {},
    )
    for name in ("s0", "s1"):
        assert torch.equal(as_bytes(kv[name][[20, 21, 22]]), as_bytes(original[name][[5, 9, 2]]))
    assert torch.equal(as_bytes(kv["f0"][[10, 11]]), as_bytes(original["f0"][[7, 3]]))
    assert loaded.bytes_moved == 3 * layout().groups[0].block_bytes + 2 * 128
    cpu = engine.stats()["cpu"]  # the engine's copies into and out of the slab, per chunk
    assert (cpu.stores, cpu.loads, cpu.store_failures, cpu.load_failures) == (3, 3, 0, 0)
    chunk_bytes = [g.chunk_bytes(BPC) for g in layout().groups]
    assert cpu.store_bytes == 2 * chunk_bytes[0] + chunk_bytes[1] == stored.bytes_moved
    assert cpu.load_bytes == loaded.bytes_moved and cpu.misses == 0
    assert (cpu.chunks, cpu.used_bytes) == (3, cpu.store_bytes)
    engine.cascade.check_integrity()


def test_failed_load_reports_block_ids_and_leaves_engine_blocks_alone(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    engine.submit_store([ChunkSpan(0, (b"a", b"c"), (0, 2), BlockSpan((0, 1, 4, 5)))])
    finish(engine)
    before = as_bytes(kv["s0"]).clone()
    # Chunk b was never stored; a and c were.
    keys, slots = (b"a", b"b", b"c"), (0, 1, 2)
    engine.submit_load([ChunkSpan(0, keys, slots, BlockSpan((10, 11, 12, 13, 14), 1))])
    [result] = finish(engine)
    assert result.status is JobStatus.PARTIAL
    assert result.failed_keys == (b"b",) and result.done_keys == (b"a", b"c")
    assert dict(result.failed_blocks) == {0: (11, 12)}
    after = as_bytes(kv["s0"])
    assert torch.equal(after[[11, 12]], before[[11, 12]])  # never wrong KV
    assert torch.equal(after[[10, 13, 14]], as_bytes(kv["s0"][[1, 4, 5]]))
    cpu = engine.stats()["cpu"]
    assert (cpu.misses, cpu.loads, cpu.load_failures) == (1, 2, 0)  # b: in no tier at all


def test_a_load_of_nothing_stored_fails_every_block(engine: OffloadEngine) -> None:
    engine.submit_load([ChunkSpan(1, (b"x", b"y"), (3, 4), BlockSpan((1, 2, 3, 4)))])
    [result] = finish(engine)
    assert result.status is JobStatus.FAILED
    assert dict(result.failed_blocks) == {1: (1, 2, 3, 4)}
    assert result.errors  # says why


def test_failed_store_is_reported_and_counted(engine: OffloadEngine) -> None:
    job = engine.submit_store([ChunkSpan(0, (b"bad",), (0,), BlockSpan((1, NUM_BLOCKS)))])
    [result] = finish(engine)
    assert (result.job_id, result.status, result.failed_keys) == (job, JobStatus.FAILED, (b"bad",))
    assert "num_blocks" in result.errors[0]
    cpu = engine.stats()["cpu"]
    assert (cpu.store_failures, cpu.stores, cpu.chunks) == (1, 0, 0)
    assert not engine.cascade.cpu.holds(b"bad", 0)
    engine.cascade.check_integrity()


def test_submit_checks_the_span_shape(engine: OffloadEngine) -> None:
    with pytest.raises(TransferError, match="whole chunks"):
        engine.submit_store([ChunkSpan(0, (b"a",), (0,), BlockSpan((1,)))])
    with pytest.raises(TransferError, match="whole chunks"):
        engine.submit_store([ChunkSpan(0, (b"a",), (0,), BlockSpan((1,), first_offset=1))])
    with pytest.raises(TransferError, match="2 keys and 1 slots"):
        engine.submit_load([ChunkSpan(0, (b"a", b"b"), (0,), BlockSpan((1, 2, 3)))])
    assert engine.wait(timeout=0) and engine.get_finished() == []  # nothing was submitted


@pytest.mark.parametrize("path", PATHS)
def test_concurrent_stores_and_loads_of_one_chunk_never_mix(path: TransferPath) -> None:
    # Big pages over several layers, so an unserialised store and load would interleave;
    # on CUDA each job thread copies on a stream of its own.
    lay = KVLayout((CacheGroup("full", 2, ("a", "b", "c", "d"), 2 * 2 * 4096 * 2),))
    kv = allocate_kv_caches(lay, NUM_BLOCKS, torch.bfloat16, device=path.device)
    fill_blocks(kv, seed=12)
    cpu = slab(path, 8, lay.groups[0].chunk_bytes(BPC))
    engine = OffloadEngine.create(path.transfer(lay, kv, BPC), cpu, max_workers=4)

    def state(blocks: list[int]) -> list[torch.Tensor]:
        return [as_bytes(kv[n][blocks]).clone() for n in "abcd"]

    # Blocks 0-1 and 2-3 hold two versions of chunk K; load i lands in 8+2i, 9+2i.
    versions = [state([0, 1]), state([2, 3])]
    engine.submit_store([ChunkSpan(0, (b"K",), (5,), BlockSpan((0, 1)))])
    finish(engine)
    start = threading.Barrier(4)

    def storer(version: int) -> None:
        start.wait()
        for _ in range(30):
            blocks = (2 * version, 2 * version + 1)
            engine.submit_store([ChunkSpan(0, (b"K",), (5,), BlockSpan(blocks))])

    def loader(first: int) -> None:
        start.wait()
        for i in range(first, 12, 2):
            engine.submit_load([ChunkSpan(0, (b"K",), (5,), BlockSpan((8 + 2 * i, 9 + 2 * i)))])

    threads = [threading.Thread(target=storer, args=(v,)) for v in (0, 1)]
    threads += [threading.Thread(target=loader, args=(f,)) for f in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = finish(engine)
    engine.close()
    assert len(results) == 72 and all(r.status is JobStatus.SUCCESS for r in results)
    for i in range(12):
        loaded = state([8 + 2 * i, 9 + 2 * i])
        assert any(
            all(torch.equal(x, y) for x, y in zip(loaded, v, strict=True)) for v in versions
        ), f"load {i} mixed two stores"
    cpu.check_integrity()


def test_wait_for_any_returns_when_a_result_waits_or_nothing_is_pending(
    engine: OffloadEngine,
) -> None:
    assert engine.wait_for_any(timeout=0)  # nothing pending
    engine.submit_store([ChunkSpan(0, (b"a",), (0,), BlockSpan((1, 2)))])
    assert engine.wait_for_any(timeout=60)
    [result] = engine.get_finished()
    assert result.status is JobStatus.SUCCESS


def test_close_finishes_jobs_and_refuses_new_ones(engine: OffloadEngine) -> None:
    engine.submit_store([ChunkSpan(0, (b"a",), (0,), BlockSpan((1, 2)))])
    engine.close()
    engine.close()
    [result] = engine.get_finished()
    assert result.status is JobStatus.SUCCESS
    with pytest.raises(TransferError, match="closed"):
        engine.submit_load([ChunkSpan(0, (b"a",), (0,), BlockSpan((1, 2)))])


@pytest.mark.parametrize("choice", ["off", "auto", "always"])
def test_from_config_hands_transfer_kernel_to_the_transfer(
    kv: dict[str, torch.Tensor], choice: str
) -> None:
    config = build_offloading_config(
        {"cpu_bytes_to_use": 64 * 1024, "blocks_per_chunk": BPC, "transfer_kernel": choice},
        layout(),
    )
    if choice == "always":
        pytest.importorskip("triton")  # the interpreter runs it on host tensors
    engine = OffloadEngine.from_config(config, kv, namespace=b"ns")
    try:
        assert engine.transfer.kernel.value == choice
    finally:
        engine.close()


def test_from_config_builds_cpu_slab_of_the_configured_size(kv: dict[str, torch.Tensor]) -> None:
    config = build_offloading_config(
        {"cpu_bytes_to_use": 64 * 1024, "blocks_per_chunk": BPC}, layout()
    )
    engine = OffloadEngine.from_config(config, kv, namespace=b"ns")
    try:
        assert engine.cascade.cpu.num_slots == config.num_cpu_chunks
        assert engine.cascade.cpu.slot_bytes == config.max_chunk_bytes
        assert engine.cascade.lower == ()
        engine.submit_store([ChunkSpan(1, (b"z",), (0,), BlockSpan((5, 6)))])
        [result] = finish(engine)
        assert result.status is JobStatus.SUCCESS
    finally:
        engine.close()


@pytest.mark.parametrize("path", [p for p in PATHS if p.id.startswith("cuda")])
def test_a_store_copies_the_kv_the_forward_pass_is_still_writing(path: TransferPath) -> None:
    """The store waits on the engine's stream: it copies what the kernels queued before it wrote."""
    lay = layout()
    kv = allocate_kv_caches(lay, NUM_BLOCKS, torch.bfloat16, device=path.device)
    eng = OffloadEngine.create(
        path.transfer(lay, kv, BPC), slab(path, 4, lay.groups[1].chunk_bytes(BPC))
    )
    try:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued on the engine's stream
        kv["f0"][[6, 7]] = 3.0  # the "forward pass": runs only after the sleep
        eng.submit_store([ChunkSpan(1, (b"late",), (0,), BlockSpan((6, 7)))])
        [stored] = finish(eng)
        assert stored.status is JobStatus.SUCCESS
        kv["f0"].zero_()
        eng.submit_load([ChunkSpan(1, (b"late",), (0,), BlockSpan((1, 2)))])
        [loaded] = finish(eng)
        assert loaded.status is JobStatus.SUCCESS
        assert bool((kv["f0"][[1, 2]] == 3.0).all()), (
            "the store copied the KV before it was written"
        )
    finally:
        eng.close()


def test_the_engines_modules_import_one_way() -> None:
    """No module of ``kvoffload/engine`` imports one that imports it back, even for types only:
    each helper is handed what it uses, and none reaches back into the engine."""
    folder = Path(kvoffload.engine.__file__).parent
    imports: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imports[f"kvoffload.engine.{path.stem}"] = set(found)
    left = dict(imports)
    while ready := [m for m, names in left.items() if not names & left.keys() - {m}]:
        for module in ready:
            del left[module]
    assert not left, f"modules in or behind an import circle: {sorted(left)}"


# -- a slow lower tier never holds up jobs on other chunks ------------------------------
class GatedReads(WrappedTier):
    """A real disk tier whose reads wait until the test lets them go (``gate``)."""

    def __init__(self, tier: DiskTier) -> None:
        super().__init__(tier)
        self.gate = threading.Event()
        self.reading = threading.Semaphore(0)  # released once a read waits at the gate

    def get_into(self, key: bytes, out: ChunkBuffer) -> bool:
        self.reading.release()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super().get_into(key, out)

    def put(self, key: bytes, data: ChunkBuffer) -> None:
        self.tier.put(key, data)

    def stats(self) -> TierStats:
        return self.tier.stats()

    def waiting(self, reads: int = 1) -> None:
        """Return once ``reads`` more reads wait at the gate."""
        for _ in range(reads):
            assert self.reading.acquire(timeout=10), "no read reached the gate"


FULL = 1  # the full-attention group: 2 blocks, 256 bytes a chunk


@pytest.fixture
def gated(
    path: TransferPath, kv: dict[str, torch.Tensor], tmp_path: Path
) -> Iterator[tuple[OffloadEngine, GatedReads]]:
    """An engine over 64 CPU slots and a disk whose reads wait at a gate, holding ``d0``-``d39``."""
    lay = layout()
    disk = GatedReads(DiskTier(tmp_path / "disk", 1 << 20, b"test-gated-reads"))
    nbytes = lay.groups[FULL].chunk_bytes(BPC)
    for i in range(40):
        disk.put(b"d%d" % i, np.full(nbytes, i, dtype=np.uint8))
    cpu = slab(path, 64, max(g.chunk_bytes(BPC) for g in lay.groups))
    eng = OffloadEngine.create(path.transfer(lay, kv, BPC), cpu, [disk])
    try:
        yield eng, disk
    finally:
        disk.gate.set()
        eng.close()


def promotion(first: int, count: int) -> ChunkSpan:
    """Disk chunks ``d<first>...`` into slots ``first...``."""
    keys = tuple(b"d%d" % i for i in range(first, first + count))
    return ChunkSpan(FULL, keys, tuple(range(first, first + count)), BlockSpan(()))


def other_stores(engine: OffloadEngine, count: int, first_slot: int) -> list[int]:
    """``count`` one-chunk stores of chunks nobody else touches, one job each."""
    return [
        engine.submit_store([ChunkSpan(FULL, (b"o%d" % i,), (first_slot + i,), BlockSpan((1, 2)))])
        for i in range(count)
    ]


def test_stores_copy_out_while_two_reads_of_other_chunks_are_blocked(
    gated: tuple[OffloadEngine, GatedReads],
) -> None:
    """A promotion and a load each wait in a disk read: a store of other chunks submitted
    after them still copies its blocks out, so the engine's step need not wait for disks.
    (The promotion goes first: it reads no chunk while a load runs.)"""
    engine, disk = gated
    promote = engine.submit_promote([promotion(1, 1)])
    disk.waiting()
    load = engine.submit_load([ChunkSpan(FULL, (b"d0",), (0,), BlockSpan((20, 21)))])
    disk.waiting()
    stores = other_stores(engine, 1, first_slot=40)
    assert engine.wait_for_sources(timeout=10), "a store waited for other chunks' disk reads"
    assert {r.job_id for r in engine.get_finished()} <= set(stores)  # the reads still wait
    disk.gate.set()
    results = {r.job_id: r for r in finish(engine)}
    assert results[load].status is results[promote].status is JobStatus.SUCCESS


def test_a_promotion_reads_no_chunk_while_a_load_runs(
    gated: tuple[OffloadEngine, GatedReads],
) -> None:
    """A load waits in a disk read; a promotion of other chunks submitted after it reads
    nothing until the load is done (the queued request's fetch leaves the drive to the
    scheduled one's load), then reads all its chunks."""
    engine, disk = gated
    load = engine.submit_load([ChunkSpan(FULL, (b"d0",), (0,), BlockSpan((20, 21)))])
    disk.waiting()
    promote = engine.submit_promote([promotion(1, 3)])
    # Without the wait, the promotion's first read reaches the gate within milliseconds.
    assert not disk.reading.acquire(timeout=1.0), "a promotion read while a load ran"
    disk.gate.set()
    results = finish(engine)
    assert [r.job_id for r in results] == [load, promote]  # the load ends first
    assert all(r.status is JobStatus.SUCCESS for r in results)
    assert results[1].done_keys == promotion(1, 3).keys


def test_jobs_on_other_chunks_never_wait_for_a_blocked_read(
    gated: tuple[OffloadEngine, GatedReads],
) -> None:
    """A promotion of 30 chunks waits in its first read; stores of 8 other chunks (other
    keys, other slots) all copy out and finish meanwhile: only what conflicts is locked."""
    engine, disk = gated
    promote = engine.submit_promote([promotion(0, 30)])
    disk.waiting()
    stores = other_stores(engine, 8, first_slot=40)
    assert engine.wait_for_sources(timeout=10), "a store waited for a read of other chunks"
    done: set[int] = set()
    while not set(stores) <= done and engine.wait_for_any(timeout=10):
        done |= {r.job_id for r in engine.get_finished()}
    assert done == set(stores), "stores of other chunks waited for a blocked read"
    disk.gate.set()
    [promoted] = finish(engine)
    assert promoted.job_id == promote and promoted.status is JobStatus.SUCCESS
    assert len(promoted.done_keys) == 30


def test_a_load_in_the_step_never_waits_for_a_blocked_read_of_other_chunks(
    gated: tuple[OffloadEngine, GatedReads], kv: dict[str, torch.Tensor]
) -> None:
    """The step's loads (CPU-tier hits) start while a promotion of other chunks waits in a
    disk read: they take the job locks of their own chunks only."""
    engine, disk = gated
    engine.submit_store([ChunkSpan(FULL, (b"hit",), (50,), BlockSpan((3, 4)))])
    finish(engine)
    promote = engine.submit_promote([promotion(0, 30)])
    disk.waiting()
    started: list[LayeredLoad] = []
    step = threading.Thread(
        target=lambda: started.append(
            engine.load_by_layer([[ChunkSpan(FULL, (b"hit",), (50,), BlockSpan((8, 9)))]])
        )
    )
    step.start()
    step.join(timeout=10)
    try:
        assert started, "the step's load waited for a read of other chunks"
        [result] = started[0].join()
        assert result.status is JobStatus.SUCCESS
        assert torch.equal(as_bytes(kv["f0"][[8, 9]]), as_bytes(kv["f0"][[3, 4]]))
    finally:
        disk.gate.set()
        step.join()
    assert [r.job_id for r in finish(engine)] == [promote]


@pytest.mark.parametrize("same", ["key", "slot"])
def test_a_store_of_a_chunk_or_slot_being_loaded_waits_for_the_load(
    gated: tuple[OffloadEngine, GatedReads], kv: dict[str, torch.Tensor], same: str
) -> None:
    """A load of ``d0`` waits in its disk read; a store of the same key (another slot) or
    into the same slot (another key) waits for it, a store of other chunks does not. The
    load brings the disk's bytes, untouched by the store that came after it."""
    engine, disk = gated
    kv["f0"][[5, 6]] = 7.0  # what the conflicting store writes
    load = engine.submit_load([ChunkSpan(FULL, (b"d0",), (0,), BlockSpan((20, 21)))])
    disk.waiting()
    key, slot = (b"d0", 9) if same == "key" else (b"x", 0)
    conflicting = engine.submit_store([ChunkSpan(FULL, (key,), (slot,), BlockSpan((5, 6)))])
    [other] = other_stores(engine, 1, first_slot=40)
    done: list[JobResult] = []
    while other not in {r.job_id for r in done} and engine.wait_for_any(timeout=10):
        done += engine.get_finished()
    assert [r.job_id for r in done] == [other], "a store of other chunks waited for a load"
    assert not engine.wait_for_sources(timeout=0), "the conflicting store did not wait"
    disk.gate.set()
    results = {r.job_id: r for r in finish(engine)}
    assert results[load].status is results[conflicting].status is JobStatus.SUCCESS
    assert bool((as_bytes(kv["f0"][[20, 21]]) == 0).all())  # d0 is zeros on disk
    engine.submit_load([ChunkSpan(FULL, (key,), (slot,), BlockSpan((22, 23)))])
    [again] = finish(engine)
    assert again.status is JobStatus.SUCCESS
    assert torch.equal(as_bytes(kv["f0"][[22, 23]]), as_bytes(kv["f0"][[5, 6]]))


def test_job_locks_keep_jobs_of_a_name_apart_in_submission_order() -> None:
    """Jobs on random overlapping names, run on 4 threads as the engine runs them: no two
    that share a name ever run at once, each name's jobs run in the order they were
    admitted, and every job ran and freed its names (no deadlock, nothing left held)."""
    locks, rng = JobLocks(), random.Random(5)
    pool = ThreadPoolExecutor(4)
    running: set[object] = set()
    order: dict[object, list[int]] = {}
    guard, mixed, ended = threading.Lock(), [], threading.Semaphore(0)

    def run(job: int, names: frozenset[int], held: Held) -> None:
        with guard:
            mixed.extend(names & running)
            running.update(names)
            for name in names:
                order.setdefault(name, []).append(job)
        time.sleep(rng.random() / 1000)
        with guard:
            running.difference_update(names)
        held.close()
        ended.release()

    jobs = [frozenset(rng.sample(range(12), rng.randint(1, 4))) for _ in range(300)]
    for job, names in enumerate(jobs):
        locks.admit(names, lambda held, j=job, n=names: pool.submit(run, j, n, held))
    ran_all = all(ended.acquire(timeout=10) for _ in jobs)
    pool.shutdown(wait=True)
    assert ran_all and not mixed and locks.idle()
    for name, ran in order.items():
        assert ran == [job for job, names in enumerate(jobs) if name in names], name
