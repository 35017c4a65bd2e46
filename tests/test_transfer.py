"""Gather/scatter round trips: every group, layout, dtype, offset and chunk size, bit-exact.

The round trips run on every transfer path (``tests/_paths.py``): host tensors
copied directly, host tensors through the CUDA path's staging code, and CUDA
tensors where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from _paths import PATHS, TransferPath, as_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import TransferError
from kvoffload.messages import BlockSpan
from kvoffload.transfer import KVSplit, KVTransfer, allocate_kv_caches, fill_blocks
from kvoffload.transfer.synthetic import EngineLayout

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
NUM_BLOCKS = 24


def gemma_like() -> KVLayout:
    """Four groups, three sliding with 8-token blocks and a full one with 2-token blocks."""
    sliding = [
        CacheGroup("sliding", 8, (f"s{i}a", f"s{i}b"), 256, sliding_window=16) for i in range(3)
    ]
    return KVLayout((*sliding, CacheGroup("full", 2, ("f0",), 2 * 2 * 4 * 8)))


def blocks_of(t: torch.Tensor, ids: list[int], layout: EngineLayout) -> torch.Tensor:
    """The given blocks of a layer tensor as bytes, whatever its layout."""
    if layout in (EngineLayout.KV_FIRST, EngineLayout.KV_FIRST_STRIDED):
        return as_bytes(t[:, ids])
    return as_bytes(t[ids])


def round_trip(  # noqa: PLR0917 - test helper, called positionally
    path: TransferPath,
    layout: KVLayout,
    engine_layout: EngineLayout,
    dtype: torch.dtype,
    bpc: int,
    group: int,
    span: BlockSpan,
    **transfer_kwargs: int,
) -> None:
    src = allocate_kv_caches(layout, NUM_BLOCKS, dtype, engine_layout, device=path.device)
    fill_blocks(src, seed=group)
    dst = allocate_kv_caches(layout, NUM_BLOCKS, dtype, engine_layout, device=path.device)
    # Bytes of their own in dst (not zeros), kept apart from it: a write outside the span,
    # zeros included, then differs from this independent copy in every layout.
    fill_blocks(dst, seed=group + 100)
    before = {n: t.clone() for n, t in dst.items()}
    out = path.transfer(layout, src, bpc, **transfer_kwargs)
    back = path.transfer(layout, dst, bpc, **transfer_kwargs)
    size = out.chunk_bytes(group)
    chunks = [path.host_buffer(size + 7) for _ in range(span.num_chunks(bpc))]
    out.gather(group, span, chunks)
    assert all(int(c[size:].count_nonzero()) == 0 for c in chunks), "wrote past the chunk"
    back.scatter(group, span, chunks)
    ids = list(span.block_ids)
    others = [b for b in range(NUM_BLOCKS) if b not in ids]
    for name in layout.groups[group].layer_names:
        assert torch.equal(blocks_of(dst[name], ids, engine_layout),
                           blocks_of(src[name], ids, engine_layout))  # fmt: skip
        assert torch.equal(blocks_of(dst[name], others, engine_layout),
                           blocks_of(before[name], others, engine_layout))  # fmt: skip
    untouched = [n for g, grp in enumerate(layout.groups) if g != group for n in grp.layer_names]
    assert all(torch.equal(as_bytes(dst[n]), as_bytes(before[n])) for n in untouched)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine_layout", list(EngineLayout))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bpc", [1, 3])
def test_round_trip_every_group(
    path: TransferPath, engine_layout: EngineLayout, dtype: torch.dtype, bpc: int
) -> None:
    layout = gemma_like()
    for group in range(len(layout.groups)):
        # Not consecutive, not sorted, and starting inside its first chunk.
        span = BlockSpan((5, 6, 7, 20, 2, 3, 11), first_offset=min(1, bpc - 1))
        round_trip(path, layout, engine_layout, dtype, bpc, group, span)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine_layout", list(EngineLayout))
def test_consecutive_blocks_whole_chunks(path: TransferPath, engine_layout: EngineLayout) -> None:
    span = BlockSpan(tuple(range(8, 16)))
    round_trip(path, gemma_like(), engine_layout, torch.bfloat16, 4, 3, span)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine_layout", list(EngineLayout))
def test_staging_in_batches_of_one_chunk(path: TransferPath, engine_layout: EngineLayout) -> None:
    """A span longer than the staging bound goes in batches; partial chunks at both ends."""
    span = BlockSpan((4, 5, 6, 7, 1, 0, 13, 12, 19, 18, 17), first_offset=2)
    round_trip(path, gemma_like(), engine_layout, torch.float16, 4, 0, span, max_staging_bytes=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine_layout", list(EngineLayout))
def test_pages_that_are_not_whole_words(path: TransferPath, engine_layout: EngineLayout) -> None:
    """12-byte pages (6-byte K and V halves): the staged path moves bytes, not 8-byte words."""
    layout = KVLayout((CacheGroup("full", 2, ("a", "b"), 2 * 2 * 3),))
    round_trip(path, layout, engine_layout, torch.uint8, 2, 0, BlockSpan((3, 9, 4, 5, 1)))


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    bpc=st.integers(1, 5),
    group=st.integers(0, 3),
    engine_layout=st.sampled_from(list(EngineLayout)),
)
def test_round_trip_property(
    path: TransferPath, data: st.DataObject, bpc: int, group: int, engine_layout: EngineLayout
) -> None:
    ids = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=12, unique=True))
    offset = data.draw(st.integers(0, bpc - 1))
    round_trip(
        path, gemma_like(), engine_layout, torch.float16, bpc, group, BlockSpan(tuple(ids), offset)
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine_layout", list(EngineLayout))
def test_every_path_writes_the_same_chunk_bytes(
    path: TransferPath, engine_layout: EngineLayout
) -> None:
    """A chunk stored from a GPU loads on a CPU host and back: the bytes never name the device."""
    layout = gemma_like()
    host = allocate_kv_caches(layout, NUM_BLOCKS, torch.bfloat16, engine_layout)
    fill_blocks(host, seed=8)
    reference = KVTransfer(layout, host, 3)
    here = {n: t.to(path.device) for n, t in host.items()}
    transfer = path.transfer(layout, here, 3)
    span = BlockSpan((2, 3, 4, 17, 9, 8, 10, 11), first_offset=1)
    for group in range(len(layout.groups)):
        size = reference.chunk_bytes(group)
        want = [torch.zeros(size, dtype=torch.uint8) for _ in range(span.num_chunks(3))]
        reference.gather(group, span, want)
        # Adjacent chunks of one buffer (the staged path's merged host copy), then apart.
        flat = path.host_buffer(size * len(want))
        for chunks in ([flat[i * size : (i + 1) * size] for i in range(len(want))],
                       [path.host_buffer(size) for _ in want][::-1]):  # fmt: skip
            transfer.gather(group, span, chunks)
            assert all(torch.equal(c, w) for c, w in zip(chunks, want, strict=True)), group


def test_chunk_byte_layout_is_layer_major_then_block_then_page() -> None:
    layout = gemma_like()
    caches = allocate_kv_caches(layout, NUM_BLOCKS, torch.uint8)
    fill_blocks(caches, seed=3)
    transfer = KVTransfer(layout, caches, blocks_per_chunk=2)
    chunk = torch.empty(transfer.chunk_bytes(0), dtype=torch.uint8)
    transfer.gather(0, BlockSpan((9, 4)), [chunk])
    a, b = (caches[n].reshape(NUM_BLOCKS, -1) for n in layout.groups[0].layer_names)
    assert torch.equal(chunk, torch.cat([a[9], a[4], b[9], b[4]]))


def test_kv_first_page_is_k_half_then_v_half_and_loads_into_block_first() -> None:
    layout = gemma_like()
    kv_first = allocate_kv_caches(layout, NUM_BLOCKS, torch.float16, EngineLayout.KV_FIRST)
    fill_blocks(kv_first, seed=4)
    block_first = allocate_kv_caches(layout, NUM_BLOCKS, torch.float16, EngineLayout.BLOCK_FIRST)
    chunk = torch.empty(KVTransfer(layout, kv_first, 1).chunk_bytes(3), dtype=torch.uint8)
    KVTransfer(layout, kv_first, 1).gather(3, BlockSpan((7,)), [chunk])
    k, v = as_bytes(kv_first["f0"][0, 7]).flatten(), as_bytes(kv_first["f0"][1, 7]).flatten()
    assert torch.equal(chunk, torch.cat([k, v]))
    KVTransfer(layout, block_first, 1).scatter(3, BlockSpan((2,)), [chunk])
    assert torch.equal(as_bytes(block_first["f0"][2]), as_bytes(kv_first["f0"][:, 7]))


def test_detects_split_from_shape_and_strides() -> None:
    layout = gemma_like()
    for engine_layout, split in [
        (EngineLayout.BLOCK_FIRST, KVSplit.BLOCK_FIRST),
        (EngineLayout.FLAT, KVSplit.BLOCK_FIRST),
        (EngineLayout.KV_FIRST, KVSplit.KV_FIRST),
        # [2, N, ...] over a [N, 2, ...] buffer: a block's page is dense, one copy.
        (EngineLayout.KV_FIRST_STRIDED, KVSplit.BLOCK_FIRST),
    ]:
        caches = allocate_kv_caches(layout, NUM_BLOCKS, torch.bfloat16, engine_layout)
        transfer = KVTransfer(layout, caches, 2)
        assert {p.split for views in transfer.groups for p in views} == {split}
        assert transfer.num_blocks(0) == NUM_BLOCKS


def test_dtype_that_does_not_match_page_bytes_names_layer_shape_and_bytes() -> None:
    layout = gemma_like()
    caches = allocate_kv_caches(layout, NUM_BLOCKS, torch.bfloat16)
    caches["f0"] = caches["f0"].to(torch.float32)  # same shape, twice the bytes
    with pytest.raises(TransferError, match=r"'f0'.*\(24, 2, 2, 16\).*128 page bytes"):
        KVTransfer(layout, caches, 1)


def test_unknown_and_missing_layers() -> None:
    layout = gemma_like()
    caches = allocate_kv_caches(layout, NUM_BLOCKS)
    extra = {**caches, "stray": torch.zeros(4, 4)}
    with pytest.raises(TransferError, match="stray"):
        KVTransfer(layout, extra, 1)
    del caches["s1b"]
    with pytest.raises(TransferError, match=r"'s1b'.*missing.*256 page bytes"):
        KVTransfer(layout, caches, 1)


def test_ambiguous_two_block_tensor_needs_a_hint() -> None:
    layout = KVLayout((CacheGroup("full", 2, ("x",), 2 * 2 * 4 * 2),))
    caches = allocate_kv_caches(layout, 2, torch.float16, EngineLayout.KV_FIRST)
    with pytest.raises(TransferError, match="ambiguous"):
        KVTransfer(layout, caches, 1)
    transfer = KVTransfer(layout, caches, 1, split=KVSplit.KV_FIRST)
    assert transfer.groups[0][0].split is KVSplit.KV_FIRST


def test_layers_of_a_group_must_share_num_blocks() -> None:
    layout = gemma_like()
    caches = allocate_kv_caches(layout, NUM_BLOCKS)
    caches["s0b"] = allocate_kv_caches(layout, NUM_BLOCKS + 1)["s0b"]
    with pytest.raises(TransferError, match="num_blocks"):
        KVTransfer(layout, caches, 1)


def test_bad_spans_and_buffers_are_refused() -> None:
    layout = gemma_like()
    transfer = KVTransfer(layout, allocate_kv_caches(layout, NUM_BLOCKS), 2)
    chunk = torch.zeros(transfer.chunk_bytes(0), dtype=torch.uint8)
    with pytest.raises(TransferError, match="num_blocks"):
        transfer.gather(0, BlockSpan((NUM_BLOCKS,)), [chunk])
    with pytest.raises(TransferError, match="2 chunks"):
        transfer.gather(0, BlockSpan((1, 2, 3)), [chunk])
    with pytest.raises(TransferError, match="cannot hold"):
        transfer.gather(0, BlockSpan((1,)), [chunk[:-1]])
    with pytest.raises(TransferError, match="uint8"):
        transfer.gather(0, BlockSpan((1,)), [chunk.view(torch.int16)])
    with pytest.raises(TransferError, match="first_offset"):
        transfer.gather(0, BlockSpan((1,), first_offset=2), [chunk])
    with pytest.raises(TransferError, match="group 9"):
        transfer.gather(9, BlockSpan((1,)), [chunk])
    with pytest.raises(TransferError, match="at least one block id"):
        transfer.gather(0, BlockSpan(()), [])  # a promotion's blocks: none to copy
    with pytest.raises(TransferError, match="non-negative"):
        BlockSpan((-1,))
    with pytest.raises(TransferError, match="non-negative"):
        BlockSpan((3, 4, -1))  # the check of a whole tuple at once sees the last one too
    with pytest.raises(TransferError, match="block id"):
        BlockSpan((3, True))
    assert BlockSpan([3, 4]).block_ids == (3, 4)  # a list is taken, as a tuple


def test_span_geometry() -> None:
    span = BlockSpan((10, 11, 12, 13, 14), first_offset=2)
    assert span.num_chunks(3) == 3
    assert span.chunk_ranges(3) == [(0, 1, 2), (1, 4, 0), (4, 5, 0)]
    assert span.sub(1, 3, 3) == BlockSpan((11, 12, 13, 14), 0)
    assert not span.covers_whole_chunks(3)
    assert BlockSpan((1, 2, 3, 4)).covers_whole_chunks(2)
