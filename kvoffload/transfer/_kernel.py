"""The kernel path of :class:`~kvoffload.transfer.KVTransfer`: one launch per call.

The torch paths cost about one operation per layer and per run of adjacent
slots (:mod:`._staged`), each tens of microseconds of Python and dispatch;
with small pages (DeepSeek-V4's groups hold 2-64 KiB per layer and block) a
chunk is many small copies and that overhead, not PCIe, sets the rate. Here
one Triton launch (:mod:`._triton`) moves every page of a ``gather`` or
``scatter`` call, all layers and chunks at once, between the engine's KV
tensors and the chunk buffers, for every layout :mod:`.views` detects:
block-first pages (FlashInfer, the CPU backend, MLA, padded state and packed
DeepSeek-V4 pages) as one piece each, K/V-first pages (FlashAttention) as a
K piece and a V piece. The bytes are those of the chunk layout of
:mod:`.copy`, so a chunk written by one path reads back by any other.

Per group a small table of pieces (base address, block stride, bytes, offset
in the chunk, step per slot) is built once; per call only the block ids,
their chunk addresses and slots travel (three int64 per block).

On CUDA the chunk buffers must be pinned host memory, which the kernel reads
and writes directly (unified addressing); a call with a pageable buffer takes
the staged path. :class:`KernelUse` says when the kernel runs: the staged
path stays the default until the kernel has been measured on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.errors import TransferError
from kvoffload.messages import BlockSpan
from kvoffload.transfer.views import KVSplit, LayerPages

__all__ = ["KernelCopier", "KernelUse", "kernel_use"]

#: Bytes one program copies at most: 2048 eight-byte words, 16 per thread of 4 warps.
_MAX_TILE_BYTES = 16 * 2**10

Launch = Callable[[torch.Tensor, torch.Tensor, tuple[int, int, int], int, int, bool, bool], None]


class KernelUse(Enum):
    """When :class:`~kvoffload.transfer.KVTransfer` moves pages with the Triton kernel."""

    #: Never: the staged path on CUDA, the direct one on host tensors (the default).
    OFF = "off"
    #: Every call (with pinned chunk buffers on CUDA); on host tensors the kernel runs in
    #: Triton's interpreter, slowly: that is how the tests check it without a GPU.
    ALWAYS = "always"
    #: On CUDA, kernel or staged DMA per group, direction and call size, whichever a
    #: calibration at start measured faster (logged once); on host tensors the torch path.
    AUTO = "auto"


def kernel_use(value: KernelUse | str) -> KernelUse:
    """Parse ``value`` (an enum member or its name), naming the choices when it is neither."""
    if isinstance(value, KernelUse):
        return value
    try:
        return KernelUse(value)
    except ValueError:
        choices = ", ".join(repr(k.value) for k in KernelUse)
        raise TransferError(f"kernel must be one of {choices}, got {value!r}") from None


def _load_launch() -> Launch:
    try:
        from kvoffload.transfer._triton import launch
    except ImportError as exc:
        raise TransferError(
            f"the transfer kernel needs Triton ({exc}); install it (`pip install triton`; "
            "vLLM's GPU installs bring it) or pass kernel='off'"
        ) from exc
    return launch


@dataclass(frozen=True, slots=True)
class _Pieces:
    """One group's piece table, on the layers' device, and what every call of it shares."""

    table: torch.Tensor  # [n_pieces, 5] int64, columns as _triton.PIECE_FIELDS
    align: int  # gcd of every address, stride and size in the table
    max_bytes: int  # the largest piece
    chunk_blocks: int


def _piece_rows(layers: Sequence[LayerPages], bpc: int) -> list[tuple[int, int, int, int, int]]:
    rows = []
    layer_start = 0  # layers' pages differ in size in DeepSeek-V4's packed groups
    for pages in layers:
        view, page = pages.pages, pages.page_bytes
        if pages.split is KVSplit.KV_FIRST:
            half, kv_stride, block_stride = page // 2, view.stride(0), view.stride(1)
            rows.append((view.data_ptr(), block_stride, half, layer_start, page))
            rows.append((view.data_ptr() + kv_stride, block_stride, half, layer_start + half, page))
        else:
            rows.append((view.data_ptr(), view.stride(0), page, layer_start, page))
        layer_start += bpc * page
    return rows


def _pieces(layers: Sequence[LayerPages], bpc: int) -> _Pieces:
    rows = _piece_rows(layers, bpc)
    table = torch.tensor(rows, dtype=torch.int64).to(layers[0].device)
    align = math.gcd(*(v for row in rows for v in row))
    return _Pieces(table, align, max(row[2] for row in rows), bpc)


def _word(align: int) -> int:
    return next(w for w in (8, 4, 2, 1) if align % w == 0)


class KernelCopier:
    """Moves a call's pages in one launch; one per :class:`~kvoffload.transfer.KVTransfer`.

    ``groups`` are the registered layers (:func:`.views.register_layers`),
    ``chunk_blocks`` each group's blocks per chunk. Raises ``TransferError``
    when Triton is missing. Thread-safe: calls only read shared state.
    """

    def __init__(self, groups: Sequence[Sequence[LayerPages]], chunk_blocks: Sequence[int]) -> None:
        self._launch = _load_launch()
        self._groups = [
            _pieces(layers, bpc) for layers, bpc in zip(groups, chunk_blocks, strict=True)
        ]
        self.device = groups[0][0].device

    def accepts(self, chunks: Sequence[torch.Tensor]) -> bool:
        """Whether the kernel can reach every chunk buffer (pinned host memory, on CUDA)."""
        if self.device.type != "cuda":
            return True
        storages = {c.untyped_storage().data_ptr(): c for c in chunks}  # slab slots: one
        return all(c.is_pinned() for c in storages.values())

    def copy(
        self,
        group: int,
        span: BlockSpan,
        ids: npt.NDArray[np.int64],
        chunks: Sequence[torch.Tensor],
        *,
        to_chunks: bool,
    ) -> None:
        """Every page of the span in one launch on the current stream (checked by the caller)."""
        pieces = self._groups[group]
        which, slot = np.divmod(np.arange(len(ids)) + span.first_offset, pieces.chunk_blocks)
        addresses = np.array([c.data_ptr() for c in chunks], dtype=np.int64)
        blocks = np.stack([ids, addresses[which], slot])
        align = math.gcd(pieces.align, int(np.gcd.reduce(addresses)))
        word = _word(align)
        words = -(-pieces.max_bytes // word)
        tile = min(1 << (words - 1).bit_length(), _MAX_TILE_BYTES // word)
        grid = (len(ids), pieces.table.shape[0], -(-words // tile))
        table = torch.from_numpy(blocks).to(self.device, non_blocking=True)
        self._launch(pieces.table, table, grid, word, tile, to_chunks, align % 16 == 0)
