"""Transfers of DeepSeek-V4's packed KV cache: mixed page sizes, padded pages, fp8 and fp32.

vLLM (0.32 and 0.33) packs every layer of DeepSeek-V4 into one int8 buffer
whose block ``b`` holds one page of every layer of a group side by side
(layout ``BLHNC``, ``block_stride`` the widest group's block), and hands the
connector one ``[num_blocks, 1, states, bytes]`` view per layer, cast to the
layer's dtype (``allocate_kv_cache`` / ``create_kv_cache_views``). Pages are
padded to 576 bytes, so a view holds fewer bytes than the page it sits in.
The geometry below is what vLLM's own grouping gives for a 6-layer model
with compress ratios ``[0, 0, 4, 128, 4, 128]`` (window 128, head 512, index
head 128), worked out in the notes and checked against vLLM's objects by
``tests_e2e/test_spec_kinds.py``; these tests need no vLLM.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from _paths import PATHS, TransferPath

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.messages import BlockSpan
from kvoffload.transfer import KVTransfer

NUM_BLOCKS = 12


class Tensor(NamedTuple):
    """One of vLLM's ``KVCacheTensor``: same-shaped layers at one offset inside each block."""

    layers: tuple[str, ...]
    page: int  # layer_stride: the padded page
    offset: int
    states: int  # N: entries per block
    content: int  # C: bytes per entry
    dtype: torch.dtype


def fp8_ds_mla() -> tuple[int, list[tuple[str, int, int, list[Tensor]]]]:
    """Block stride and groups (kind, tokens per block, window) of FlashMLA's fp8 layout."""
    u8, f32 = torch.uint8, torch.float32
    swa = [
        ("sliding_mla", 64, 128, [Tensor((f"L{i}.swa", f"L{i + 3}.swa"), 37440, 0, 64, 584, u8)])
        for i in range(3)
    ]
    mla = ("compressed_mla", 256, 0, [
        Tensor(("L2.attn", "L4.attn"), 37440, 0, 64, 584, u8),
        Tensor(("L2.idx", "L4.idx"), 8640, 74880, 64, 132, u8),
        Tensor(("L3.attn", "L5.attn"), 1728, 92160, 2, 584, u8),
    ])  # fmt: skip
    c4 = ("sliding_mla", 4, 8, [
        Tensor(("L2.comp", "L4.comp"), 32832, 0, 4, 8192, f32),
        Tensor(("L2.idx.comp", "L4.idx.comp"), 8640, 65664, 4, 2048, f32),
    ])  # fmt: skip
    c128 = ("sliding_mla", 8, 128, [Tensor(("L3.comp", "L5.comp"), 32832, 0, 8, 4096, f32)])
    return 95616, [*swa, mla, c4, c128]


def bf16_flashinfer() -> tuple[int, list[tuple[str, int, int, list[Tensor]]]]:
    """The same model with a bf16 cache (alignment 512: only the indexer page is padded)."""
    bf, f32 = torch.bfloat16, torch.float32
    swa = [
        ("sliding_mla", 64, 128, [Tensor((f"L{i}.swa", f"L{i + 3}.swa"), 65536, 0, 64, 1024, bf)])
        for i in range(3)
    ]
    mla = ("compressed_mla", 256, 0, [
        Tensor(("L2.attn", "L4.attn"), 65536, 0, 64, 1024, bf),
        Tensor(("L2.idx", "L4.idx"), 8704, 131072, 64, 132, torch.uint8),
        Tensor(("L3.attn", "L5.attn"), 2048, 148480, 2, 1024, bf),
    ])  # fmt: skip
    c4 = ("sliding_mla", 4, 8, [
        Tensor(("L2.comp", "L4.comp"), 32768, 0, 4, 8192, f32),
        Tensor(("L2.idx.comp", "L4.idx.comp"), 8192, 65536, 4, 2048, f32),
    ])  # fmt: skip
    c128 = ("sliding_mla", 8, 128, [Tensor(("L3.comp", "L5.comp"), 32768, 0, 8, 4096, f32)])
    return 152576, [*swa, mla, c4, c128]


def vllm_views(
    block_stride: int, groups: list[tuple[str, int, int, list[Tensor]]], buffer: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-layer views of ``buffer`` exactly as vLLM's ``create_kv_cache_views`` makes them."""
    views = {}
    for _, _, _, tensors in groups:
        for t in tensors:
            es = torch.empty(0, dtype=t.dtype).element_size()
            for layer, name in enumerate(t.layers):
                start = t.offset + layer * t.page
                raw = buffer.as_strided(
                    (NUM_BLOCKS, 1, t.states, t.content),
                    (block_stride, t.states * t.content, t.content, 1), start,
                )  # fmt: skip
                view = raw.view(t.dtype)
                assert view.stride(0) * es == block_stride
                views[name] = view
    return views


def layout_of(groups: list[tuple[str, int, int, list[Tensor]]]) -> KVLayout:
    """The layout vLLM's worker config gives (layer order: the UniformType spec's)."""
    out = []
    for kind, tpb, window, tensors in groups:
        layers = sorted(
            ((name, t.page) for t in tensors for name in t.layers),
            key=lambda item: (int(item[0][1]), item[0]),
        )
        pages = tuple(page for _, page in layers)
        out.append(
            CacheGroup(
                kind, tpb, tuple(name for name, _ in layers), max(pages),
                sliding_window=window or None, layer_page_bytes=pages,
            )
        )  # fmt: skip
    return KVLayout(tuple(out))


def page_bytes(view: torch.Tensor, block: int, page: int, block_stride: int) -> torch.Tensor:
    """The ``page`` bytes of ``block`` where ``view`` starts, padding included."""
    flat = torch.empty(0, dtype=torch.uint8, device=view.device)
    flat.set_(view.untyped_storage())
    start = view.storage_offset() * view.element_size() + block * block_stride
    return flat[start : start + page]


GEOMETRIES = {"fp8_ds_mla": fp8_ds_mla, "bf16": bf16_flashinfer}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("bpc", [1, 2])
def test_every_packed_group_round_trips_bit_exact_and_touches_nothing_else(
    path: TransferPath, geometry: str, bpc: int
) -> None:
    block_stride, groups = GEOMETRIES[geometry]()
    layout = layout_of(groups)
    gen = torch.Generator().manual_seed(7)
    nbytes = NUM_BLOCKS * block_stride

    def buffer() -> torch.Tensor:
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        return raw.view(torch.int8).to(path.device)

    src_buf = buffer()
    src = vllm_views(block_stride, groups, src_buf)
    out = path.transfer(layout, src, bpc)
    ids = (9, 2, 5, 6) if bpc == 2 else (9, 2, 5)
    span = BlockSpan(ids, first_offset=1 if bpc == 2 else 0)
    for g, group in enumerate(layout.groups):
        dst_buf = buffer()
        before = dst_buf.clone()
        back = path.transfer(layout, vllm_views(block_stride, groups, dst_buf), bpc)
        size = out.chunk_bytes(g)
        assert size == group.block_bytes * bpc
        chunks = [path.host_buffer(size + 5) for _ in range(span.num_chunks(bpc))]
        out.gather(g, span, chunks)
        back.scatter(g, span, chunks)
        expected = before.view(torch.uint8).clone()
        dst = vllm_views(block_stride, groups, dst_buf)
        for name, page in zip(group.layer_names, group.layer_pages, strict=True):
            for b in ids:
                got = page_bytes(dst[name], b, page, block_stride)
                assert torch.equal(got, page_bytes(src[name], b, page, block_stride)), (name, b)
                start = dst[name].storage_offset() * dst[name].element_size() + b * block_stride
                expected[start : start + page] = got
        assert torch.equal(dst_buf.view(torch.uint8), expected), f"group {g} wrote elsewhere"


def test_chunk_bytes_are_layer_major_with_each_layers_own_page() -> None:
    block_stride, groups = fp8_ds_mla()
    layout = layout_of(groups)
    buf = torch.randint(0, 256, (NUM_BLOCKS * block_stride,), dtype=torch.uint8).view(torch.int8)
    views = vllm_views(block_stride, groups, buf)
    transfer = KVTransfer(layout, views, 2)
    g = 3  # MLA r4, indexer, MLA r128: pages of 37440, 8640 and 1728 bytes
    chunk = torch.zeros(transfer.chunk_bytes(g), dtype=torch.uint8)
    transfer.gather(g, BlockSpan((4, 8)), [chunk])
    at = 0
    for name, page in zip(layout.groups[g].layer_names, layout.groups[g].layer_pages, strict=True):
        for b in (4, 8):
            want = page_bytes(views[name], b, page, block_stride)
            assert torch.equal(chunk[at : at + page], want)
            at += page
    assert at == chunk.numel()
