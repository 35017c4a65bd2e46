"""Synthetic engine KV tensors for tests, the demo and ``kvoffload bench``.

They have the shapes vLLM's attention backends hand to a connector, so code
exercised on them meets the same views as in the engine; no engine needed.
"""

from __future__ import annotations

from enum import Enum

import torch

from kvoffload.config.layout import CacheGroup, KVLayout, Reuse
from kvoffload.errors import TransferError

__all__ = ["EngineLayout", "allocate_kv_caches", "fill_blocks", "state_page_stride"]


class EngineLayout(Enum):
    """Tensor layouts of vLLM attention backends (per layer)."""

    #: CPU backend, FlashInfer: ``[num_blocks, 2, tokens_per_block, heads * head_size]``.
    BLOCK_FIRST = "block_first"
    #: FlashAttention: ``[2, num_blocks, tokens_per_block, heads * head_size]``.
    KV_FIRST = "kv_first"
    #: ``[2, num_blocks, ...]`` as a strided view of a ``[num_blocks, 2, ...]`` buffer.
    KV_FIRST_STRIDED = "kv_first_strided"
    #: MLA and other unsplit caches: ``[num_blocks, tokens_per_block, dim]``.
    FLAT = "flat"


def _row_elems(page_bytes: int, tokens_per_block: int, parts: int, element_size: int) -> int:
    per_token = page_bytes // element_size // tokens_per_block
    if page_bytes % (element_size * tokens_per_block * parts) or per_token % parts:
        raise TransferError(
            f"page_bytes {page_bytes} does not split into {parts} x "
            f"{tokens_per_block} tokens of {element_size}-byte elements"
        )
    return per_token // parts


def _layer_tensor(  # noqa: PLR0917 - private helper, called positionally
    page_bytes: int,
    tpb: int,
    num_blocks: int,
    dtype: torch.dtype,
    layout: EngineLayout,
    device: str,
) -> torch.Tensor:
    es = torch.empty(0, dtype=dtype).element_size()
    if layout is EngineLayout.FLAT:
        row = _row_elems(page_bytes, tpb, 1, es)
        return torch.zeros(num_blocks, tpb, row, dtype=dtype, device=device)
    row = _row_elems(page_bytes, tpb, 2, es)
    if layout is EngineLayout.BLOCK_FIRST:
        return torch.zeros(num_blocks, 2, tpb, row, dtype=dtype, device=device)
    if layout is EngineLayout.KV_FIRST:
        return torch.zeros(2, num_blocks, tpb, row, dtype=dtype, device=device)
    return torch.zeros(num_blocks, 2, tpb, row, dtype=dtype, device=device).transpose(0, 1)


def _state_tensor(group: CacheGroup, num_blocks: int, stride: int, device: str) -> torch.Tensor:
    """A recurrent layer as vLLM hands it over: ``[num_blocks, 1, 1, state_bytes]`` of int8
    whose blocks lie ``stride`` bytes apart (vLLM pads a state page to the attention page)."""
    buffer = torch.zeros(num_blocks * stride, dtype=torch.int8, device=device)
    return buffer.as_strided(
        (num_blocks, 1, 1, group.page_bytes), (stride, group.page_bytes, group.page_bytes, 1)
    )


def state_page_stride(layout: KVLayout, group: CacheGroup) -> int:
    """Block stride of a synthetic state tensor: the largest page of the layout, always padded."""
    largest = max(g.page_bytes for g in layout.groups)
    return -(-max(largest, group.page_bytes + 1) // 64) * 64


def allocate_kv_caches(
    layout: KVLayout,
    num_blocks: int,
    dtype: torch.dtype = torch.bfloat16,
    engine_layout: EngineLayout = EngineLayout.BLOCK_FIRST,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Zeroed per-layer KV tensors for ``layout``, as ``register_kv_caches`` receives them.

    State groups get vLLM's recurrent-state views whatever ``engine_layout`` says.
    """
    out = {}
    for group in layout.groups:
        for name, page in zip(group.layer_names, group.layer_pages, strict=True):
            if group.reuse is Reuse.STATE:
                stride = state_page_stride(layout, group)
                out[name] = _state_tensor(group, num_blocks, stride, device)
            else:
                tpb = group.tokens_per_block
                out[name] = _layer_tensor(page, tpb, num_blocks, dtype, engine_layout, device)
    return out


def fill_blocks(kv_caches: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Fill every tensor with reproducible random bytes (NaN patterns included).

    The bytes are drawn on each tensor's own device (gigabytes of CUDA KV in
    milliseconds), so they repeat for one seed and device, not across devices.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for tensor in kv_caches.values():
        if tensor.device not in generators:
            generators[tensor.device] = torch.Generator(tensor.device).manual_seed(seed)
        raw = torch.randint(
            0,
            256,
            (tensor.numel() * tensor.element_size(),),
            dtype=torch.uint8,
            generator=generators[tensor.device],
            device=tensor.device,
        )
        flat = raw.view(tensor.dtype).view(tensor.shape) if tensor.dim() else raw
        tensor.copy_(flat)
