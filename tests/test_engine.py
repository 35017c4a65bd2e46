"""The offload engine: async jobs, verified loads, reported failures, no races per chunk.

The engine's tests run on every transfer path (``tests/_paths.py``), CUDA
tensors with pinned slabs included where a GPU is present.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _paths import PATHS, TransferPath, as_bytes

import kvoffload.engine
from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.engine import ChunkSpan, JobKind, JobResult, JobStatus, OffloadEngine
from kvoffload.errors import TransferError
from kvoffload.messages import BlockSpan
from kvoffload.tiers.cpu import CPUSlab
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
