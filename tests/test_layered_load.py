"""Loads in the step, copied layer by layer (``kvoffload.engine._layered``) on real tensors.

vLLM calls ``wait_for_layer_load(layer)`` before each attention layer reads its
KV; these tests hold what each copy mode promises at that call: the layer's
blocks (and every earlier layer's) are in place, nothing a verification
refused is ever copied, and every failure is reported by block.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from _paths import PATHS, TransferPath, as_bytes

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.engine import ChunkSpan, CopyMode, JobStatus, OffloadEngine
from kvoffload.engine._layered import COPY_MODE_ENV, model_order
from kvoffload.errors import ConfigError, TierError, TransferError
from kvoffload.messages import BlockSpan
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.transfer import allocate_kv_caches, fill_blocks

NUM_BLOCKS = 24
BPC = 2
#: Registered out of the model's order, with pages of three sizes (as DeepSeek-V4's groups).
NAMES = ("model.layers.2.attn", "model.layers.0.attn", "model.layers.1.attn")
MODEL_ORDER = sorted(NAMES)
PAGES = (128, 64, 256)


def layout() -> KVLayout:
    group = CacheGroup("full", 4, NAMES, max(PAGES), layer_page_bytes=PAGES)
    return KVLayout((group,))


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> TransferPath:
    param: TransferPath = request.param
    return param


@pytest.fixture
def kv(path: TransferPath) -> dict[str, torch.Tensor]:
    caches = allocate_kv_caches(layout(), NUM_BLOCKS, torch.bfloat16, device=path.device)
    fill_blocks(caches, seed=3)
    return caches


@pytest.fixture
def engine(path: TransferPath, kv: dict[str, torch.Tensor]) -> Iterator[OffloadEngine]:
    lay = layout()
    slab = CPUSlab(8, lay.groups[0].chunk_bytes(BPC), pin_memory=path.device == "cuda")
    eng = OffloadEngine.create(path.transfer(lay, kv, BPC), slab)
    yield eng
    eng.close()


def stored(engine: OffloadEngine, kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Chunks a, b, c stored from blocks 0..5; the engine's KV then zeroed."""
    engine.submit_store([ChunkSpan(0, (b"a", b"b", b"c"), (0, 1, 2), BlockSpan(tuple(range(6))))])
    assert engine.wait(timeout=60)
    [result] = engine.get_finished()
    assert result.status is JobStatus.SUCCESS
    original = {n: as_bytes(t).clone() for n, t in kv.items()}
    for t in kv.values():
        t.zero_()
    return original


#: Into blocks 10..14, the first chunk entered at its second block.
LOAD = ChunkSpan(0, (b"a", b"b", b"c"), (0, 1, 2), BlockSpan((10, 11, 12, 13, 14), 1))
SOURCE = [1, 2, 3, 4, 5]


def loaded(kv: dict[str, torch.Tensor], original: dict[str, torch.Tensor], name: str) -> bool:
    return torch.equal(as_bytes(kv[name])[10:15], original[name][SOURCE])


def untouched(kv: dict[str, torch.Tensor], name: str) -> bool:
    return not as_bytes(kv[name])[10:15].any()


def test_model_order_follows_the_layer_index_in_the_name() -> None:
    names = ["model.layers.10.a", "drafter.fc", "model.layers.2.a", "model.layers.2.b"]
    in_order = ["model.layers.2.a", "model.layers.2.b", "model.layers.10.a", "drafter.fc"]
    assert model_order(names) == in_order


def test_one_layer_at_a_time_equals_every_layer_at_once(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    original = stored(engine, kv)
    cpu, size = engine.cascade.cpu, layout().groups[0].chunk_bytes(BPC)
    buffers = [cpu.slot(slot, size) for slot in LOAD.slots]
    for layer in range(len(NAMES)):
        engine.transfer.scatter(0, LOAD.blocks, buffers, layer=layer)
        for done, name in enumerate(NAMES):
            assert loaded(kv, original, name) == (done <= layer), (layer, name)
    with pytest.raises(TransferError, match=r"group 0 has layers 0\.\.2, not 3"):
        engine.transfer.scatter(0, LOAD.blocks, buffers, layer=3)


def test_layer_mode_copies_each_layer_when_it_is_waited_for(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    original = stored(engine, kv)
    load = engine.load_by_layer([[LOAD]], CopyMode.LAYER)
    assert all(untouched(kv, name) for name in NAMES)  # verified, nothing copied yet
    for n, name in enumerate(MODEL_ORDER):
        load.wait_layer(name)
        assert [loaded(kv, original, m) for m in MODEL_ORDER] == [i <= n for i in range(3)]
    [result] = load.join()
    assert result.status is JobStatus.SUCCESS and result.done_keys == LOAD.keys
    assert result.bytes_moved == 5 * sum(PAGES)
    cpu = engine.stats()["cpu"]
    assert (cpu.loads, cpu.load_bytes, cpu.load_failures) == (3, 5 * sum(PAGES), 0)
    assert engine.wait(timeout=1)  # nothing pending: the load ended with its join


def test_a_wait_for_a_layer_the_load_does_not_know_waits_for_every_layer(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    original = stored(engine, kv)
    load = engine.load_by_layer([[LOAD]], CopyMode.LAYER)
    load.wait_layer("model.layers.3.shared_kv")  # reads another layer's KV, say
    assert all(loaded(kv, original, name) for name in NAMES)
    load.join()


@pytest.mark.parametrize("mode", list(CopyMode))
def test_every_mode_has_a_layer_in_place_when_its_wait_returns(
    engine: OffloadEngine, kv: dict[str, torch.Tensor], mode: CopyMode
) -> None:
    original = stored(engine, kv)
    load = engine.load_by_layer([[LOAD]], mode)
    for name in MODEL_ORDER:
        load.wait_layer(name)
        assert loaded(kv, original, name), name
    [result] = load.join()
    assert result.status is JobStatus.SUCCESS


@pytest.mark.parametrize("mode", list(CopyMode))
def test_a_chunk_no_tier_holds_is_never_copied_and_its_blocks_are_reported(
    engine: OffloadEngine, kv: dict[str, torch.Tensor], mode: CopyMode
) -> None:
    original = stored(engine, kv)
    missing = ChunkSpan(0, (b"a", b"x", b"c"), (0, 3, 2), LOAD.blocks)
    other = ChunkSpan(0, (b"b",), (1,), BlockSpan((20, 21)))
    load = engine.load_by_layer([[missing], [other]], mode)
    for name in MODEL_ORDER:
        load.wait_layer(name)
    first, second = load.join()
    assert first.status is JobStatus.PARTIAL and first.failed_keys == (b"x",)
    assert dict(first.failed_blocks) == {0: (11, 12)}
    assert second.status is JobStatus.SUCCESS  # one job's failure is its own
    for name in NAMES:
        engine_bytes, source = as_bytes(kv[name]), original[name]
        assert not engine_bytes[[11, 12]].any()  # never wrong KV
        assert torch.equal(engine_bytes[[10, 13, 14]], source[[1, 4, 5]])
        assert torch.equal(engine_bytes[[20, 21]], source[[2, 3]])


@pytest.mark.parametrize("mode", list(CopyMode))
def test_a_copy_that_fails_fails_its_run_never_the_wait(
    engine: OffloadEngine, kv: dict[str, torch.Tensor], mode: CopyMode
) -> None:
    stored(engine, kv)
    beyond = ChunkSpan(0, (b"a",), (0,), BlockSpan((10, NUM_BLOCKS)))  # no such engine block
    load = engine.load_by_layer([[beyond]], mode)
    for name in MODEL_ORDER:
        load.wait_layer(name)
    [result] = load.join()
    assert result.status is JobStatus.FAILED and dict(result.failed_blocks) == {0: (10, 24)}
    assert any("num_blocks" in line for line in result.errors)
    assert all(untouched(kv, name) for name in NAMES)


def test_the_copy_mode_is_measured_per_device_unless_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(COPY_MODE_ENV, raising=False)
    assert CopyMode.default(cuda=False) is CopyMode.BEFORE
    assert CopyMode.default(cuda=True) is CopyMode.THREAD
    monkeypatch.setenv(COPY_MODE_ENV, " Layer ")
    assert CopyMode.default(cuda=True) is CopyMode.LAYER
    monkeypatch.setenv(COPY_MODE_ENV, "eager")
    refusal = f"{COPY_MODE_ENV}='eager' is not a copy mode; use one of thread, layer, before"
    with pytest.raises(ConfigError, match=refusal):
        CopyMode.default(cuda=False)


def test_a_verification_that_raises_leaves_no_lock_or_job_behind(
    engine: OffloadEngine, kv: dict[str, torch.Tensor]
) -> None:
    stored(engine, kv)
    no_slot = ChunkSpan(0, (b"a",), (99,), BlockSpan((10, 11)))  # the slab has 8 slots
    with pytest.raises(TierError, match=r"slot must be an int in \[0, 7\], got 99"):
        engine.load_by_layer([[no_slot]], CopyMode.LAYER)
    assert engine.wait(timeout=1)  # not pending
    refused: list[Exception] = []

    def again() -> None:  # takes the same locks before it is refused the same way
        try:
            engine.load_by_layer([[no_slot]], CopyMode.LAYER)
        except TierError as exc:
            refused.append(exc)

    taker = threading.Thread(target=again, daemon=True)
    taker.start()
    taker.join(timeout=10)
    assert not taker.is_alive(), "the failed load still holds its chunks' locks"
    assert len(refused) == 1
    load = engine.load_by_layer([[LOAD]], CopyMode.LAYER)
    [result] = load.join()
    assert result.status is JobStatus.SUCCESS
