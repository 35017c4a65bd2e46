"""Byte views of the engine's KV tensors: which dimension is the block, where a page lives.

vLLM hands a connector one tensor per layer (``register_kv_caches``) whose
shape depends on the attention backend:

* block-first, ``[num_blocks, ...]``: the CPU backend's
  ``[num_blocks, 2, tokens_per_block, heads * head_size]``, FlashInfer's
  ``[num_blocks, 2, ...]``, MLA's ``[num_blocks, tokens_per_block, dim]``;
* K/V-first, ``[2, num_blocks, ...]``: FlashAttention's split K and V halves.

Nothing here assumes a backend: the block dimension is the one whose stride
steps over exactly ``page_bytes`` of dense memory per block, found from the
tensor's shape, strides and dtype together with the layer's ``page_bytes``.
A K/V-first tensor whose strides put the two halves of a block next to each
other (a "logical" ``[2, N]`` over a physical ``[N, 2]`` buffer) is treated as
block-first, so it takes the single-copy path.

A page may be *padded*: vLLM rounds some pages up (DeepSeek-V4's MLA pages to
576 bytes, a Mamba state page to the attention page) and hands a view of the
content alone, ``[num_blocks, ...]`` with fewer dense bytes than the page and
a block stride of at least the page. The padding after the content belongs
to that page (vLLM places the next layer or block after it), so the page view
takes it along: one dense run of ``page_bytes`` per block still.

Each layer becomes a :class:`LayerPages`: a ``uint8`` view ``[num_blocks,
page_bytes]`` (block-first) or ``[2, num_blocks, page_bytes // 2]``
(K/V-first) of the very same memory, so copies through it move the engine's
bytes with no conversion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch

from kvoffload.config.layout import KVLayout
from kvoffload.errors import TransferError

__all__ = ["KVSplit", "LayerPages", "layer_pages", "register_layers"]


class KVSplit(Enum):
    """Where the block dimension of a layer tensor is."""

    #: ``[num_blocks, ...]``: one block's page is one dense run of bytes.
    BLOCK_FIRST = "block_first"
    #: ``[2, num_blocks, ...]``: a block's K half and V half lie apart.
    KV_FIRST = "kv_first"


@dataclass(frozen=True, slots=True)
class LayerPages:
    """One layer's KV memory as pages of bytes."""

    name: str
    split: KVSplit
    num_blocks: int
    page_bytes: int
    #: ``uint8`` view: ``[num_blocks, page_bytes]`` or ``[2, num_blocks, page_bytes // 2]``.
    pages: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.pages.device


def _dense(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether dims with these sizes and strides tile one dense run of memory, in any order."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _byte_view(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """A ``uint8`` strided view of ``t``'s storage; ``size``/``stride`` in bytes."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage())
    offset = t.storage_offset() * t.element_size()
    return flat.as_strided(size, stride, offset)


def _mismatch(name: str, t: torch.Tensor, page_bytes: int, why: str) -> TransferError:
    return TransferError(
        f"layer {name!r}: tensor shape {tuple(t.shape)} stride {tuple(t.stride())} "
        f"dtype {t.dtype} does not match the layout: {why}; expected {page_bytes} "
        f"page bytes per block (K and V together) in a [num_blocks, ...] or "
        f"[2, num_blocks, ...] tensor"
    )


def _candidates(t: torch.Tensor, page_bytes: int) -> list[KVSplit]:
    shape, stride, es = tuple(t.shape), tuple(t.stride()), t.element_size()
    found = []
    if t.dim() >= 1 and _dense(shape[1:], stride[1:]):
        content = math.prod(shape[1:]) * es
        padded = content < page_bytes <= t.stride(0) * es
        if content == page_bytes or padded:
            found.append(KVSplit.BLOCK_FIRST)
    if (
        t.dim() >= 2
        and shape[0] == 2
        and 2 * math.prod(shape[2:]) * es == page_bytes
        and _dense(shape[2:], stride[2:])
    ):
        found.append(KVSplit.KV_FIRST)
    return found


def layer_pages(
    name: str, t: torch.Tensor, page_bytes: int, split: KVSplit | None = None
) -> LayerPages:
    """Detect ``t``'s block dimension and return its view as pages of ``page_bytes``.

    ``split`` is only needed when the shape cannot tell (``[2, 2, ...]``: two
    blocks either way); otherwise it is checked against what was detected.
    Raises ``TransferError`` naming the layer, shape and expected page bytes.
    """
    es = t.element_size()
    if page_bytes % es:
        raise _mismatch(name, t, page_bytes, f"page_bytes is not a multiple of the {es}-byte dtype")
    found = _candidates(t, page_bytes)
    if split is not None:
        if split not in found:
            raise _mismatch(name, t, page_bytes, f"it is not a {split.value} tensor")
        found = [split]
    if not found:
        raise _mismatch(name, t, page_bytes, "no dimension holds whole dense pages")
    if len(found) > 1:
        raise _mismatch(name, t, page_bytes, "ambiguous block dimension; pass split=KVSplit.<...>")
    half = page_bytes // 2
    if found[0] is KVSplit.BLOCK_FIRST:
        nb = t.shape[0]
        view = _byte_view(t, (nb, page_bytes), (t.stride(0) * es, 1))
        return LayerPages(name, KVSplit.BLOCK_FIRST, nb, page_bytes, view)
    nb = t.shape[1]
    if t.stride(0) * es == half and t.stride(1) * es >= page_bytes:
        # Physically block-first: K and V of a block are adjacent, one page is dense.
        view = _byte_view(t, (nb, page_bytes), (t.stride(1) * es, 1))
        return LayerPages(name, KVSplit.BLOCK_FIRST, nb, page_bytes, view)
    view = _byte_view(t, (2, nb, half), (t.stride(0) * es, t.stride(1) * es, 1))
    return LayerPages(name, KVSplit.KV_FIRST, nb, page_bytes, view)


def register_layers(
    layout: KVLayout,
    kv_caches: Mapping[str, torch.Tensor],
    split: KVSplit | None = None,
) -> tuple[tuple[LayerPages, ...], ...]:
    """Page views of every layer, grouped and ordered as in ``layout``.

    Every layer of the layout must be present, no other layer may be, and
    the layers of one group must agree on ``num_blocks`` and device (they
    share one block table).
    """
    unknown = sorted(set(kv_caches) - set(layout.layer_names))
    if unknown:
        raise TransferError(f"layers {unknown} are in no group of the layout")
    groups = []
    for g, group in enumerate(layout.groups):
        views = []
        for name, page in zip(group.layer_names, group.layer_pages, strict=True):
            if name not in kv_caches:
                raise TransferError(
                    f"layer {name!r} of group {g} is missing from the registered KV caches "
                    f"(expected {page} page bytes per block)"
                )
            views.append(layer_pages(name, kv_caches[name], page, split))
        counts = {(v.num_blocks, str(v.device)) for v in views}
        if len(counts) > 1:
            raise TransferError(
                f"group {g}: layers disagree on (num_blocks, device): {sorted(counts)}; "
                "layers of one group share one block table"
            )
        groups.append(tuple(views))
    return tuple(groups)
