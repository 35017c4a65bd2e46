"""The device path of :class:`kvoffload.transfer.KVTransfer`: stage chunks in device memory.

A chunk's bytes are layer-major (:mod:`.copy`), the engine's are block-major
per layer, so moving one chunk straight between a CUDA tensor and host memory
is a strided copy per layer, and for K/V-first tensors (FlashAttention's
``[2, num_blocks, ...]``) not even a dense one: torch then copies through a
pageable host temporary, synchronously, with an extra host memcpy. Instead a
span moves through a staging buffer on the device that holds its chunks in
their exact byte order (``[chunks, chunk_bytes]``):

* **store**: one device kernel per layer (a narrow copy for consecutive
  blocks, an ``index_select`` otherwise) writes every chunk of the span into
  the staging buffer, then one asynchronous copy per chunk (one per run of
  adjacent slab slots) moves dense bytes into pinned host memory;
* **load**: the reverse: dense host-to-device copies, then one kernel per
  layer (``index_copy_`` or a narrow copy) into the engine's blocks.

So a span costs ``layers + chunks`` copies, however its blocks are ordered,
and every host transfer is one dense DMA. The device-to-device step reads and
writes each byte once more at device bandwidth (terabytes per second against
tens of gigabytes over PCIe). Staging is bounded by ``max_staging_bytes``
per call: a longer span goes in batches of whole chunks.

The functions use only device-generic torch operations, so the same code runs
on host tensors (``KVTransfer(..., staged=True)``): the unit tests check its
bookkeeping on machines with no GPU. The stream is the caller's
(:mod:`.copy`); here everything is issued on the current stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.messages import BlockSpan
from kvoffload.transfer.views import KVSplit, LayerPages

__all__ = ["DEFAULT_MAX_STAGING_BYTES", "staged_copy"]

#: Device memory one transfer call may stage at a time (per worker thread): 64 MiB moves
#: in ~1.3 ms over PCIe 5, long enough that the per-batch launches are noise, and small
#: beside the GPU memory vLLM leaves outside its KV cache (``gpu_memory_utilization``).
DEFAULT_MAX_STAGING_BYTES = 64 * 2**20

_WORD = 8  # bytes moved per element when pages allow it (int64 instead of uint8)


def staged_copy(  # noqa: PLR0917 - private helper, called positionally by KVTransfer
    layers: Sequence[LayerPages],
    span: BlockSpan,
    ids: npt.NDArray[np.int64],
    chunks: Sequence[torch.Tensor],
    bpc: int,
    size: int,
    *,
    to_chunks: bool,
    max_staging_bytes: int,
    after: torch.cuda.Event | None = None,
) -> None:
    """Move the span's blocks between ``layers`` and ``chunks`` through a staging buffer.

    ``bpc`` and ``size`` are the group's blocks and bytes per chunk; ``ids``
    is ``span.block_ids`` as an array, checked by the caller. The current
    (CUDA) stream waits for ``after`` just before its first kernel on the
    engine's tensors: a load's host copies into staging need not wait.
    """
    device = layers[0].device
    ranges = span.chunk_ranges(bpc)
    per_batch = max(1, max_staging_bytes // size)
    for first in range(0, len(ranges), per_batch):
        stop = min(len(ranges), first + per_batch)
        staging = torch.empty((stop - first, size), dtype=torch.uint8, device=device)
        partial = not all(BlockSpan.is_whole(r, bpc) for r in ranges[first:stop])
        if not to_chunks or partial:
            # A gather into part of a chunk keeps the rest of its bytes (stores never do
            # that: they cover whole chunks), so those chunks are read in first.
            _host_copies(staging, chunks[first:stop], size, to_host=False)
        if after is not None:
            torch.cuda.current_stream(device).wait_event(after)
            after = None
        for c0, c1 in _runs(ranges, first, stop, bpc):
            start, pos, end = ranges[c0][0], ranges[c0][2], ranges[c1 - 1][1]
            index = _device_index(ids[start:end], device)
            rows = staging[c0 - first : c1 - first]
            _move_layers(
                layers,
                rows,
                pos,
                (end - start) // (c1 - c0),
                index,
                int(ids[start]),
                bpc=bpc,
                to_chunks=to_chunks,
            )
        if to_chunks:
            _host_copies(staging, chunks[first:stop], size, to_host=True)


def _runs(
    ranges: Sequence[tuple[int, int, int]], first: int, stop: int, bpc: int
) -> list[tuple[int, int]]:
    """Chunk index ranges ``[c0, c1)`` moved by one kernel per layer: whole chunks together.

    A partial chunk (the first of a load that starts inside it, the last of a
    span) is a run by itself; in the staging buffer whole chunks lie at one
    step, so any number of them forms one ``[m, blocks, page]`` view.
    """
    runs: list[tuple[int, int]] = []
    c = first
    while c < stop:
        end = c + 1
        if BlockSpan.is_whole(ranges[c], bpc):
            while end < stop and BlockSpan.is_whole(ranges[end], bpc):
                end += 1
        runs.append((c, end))
        c = end
    return runs


def _device_index(run: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor | None:
    """The run's block ids on the device, or ``None`` when they are consecutive."""
    if len(run) == 1 or bool((np.diff(run) == 1).all()):
        return None
    return torch.from_numpy(run).to(device, non_blocking=True)


def _move_layers(  # noqa: PLR0917 - private helper, called positionally
    layers: Sequence[LayerPages],
    rows: torch.Tensor,
    pos: int,
    k: int,
    index: torch.Tensor | None,
    first_block: int,
    *,
    bpc: int,
    to_chunks: bool,
) -> None:
    """One kernel per layer between the engine and ``rows`` (``[m, chunk_bytes]`` staging)."""
    m = rows.shape[0]
    layer_start = 0  # layers' pages differ in size in DeepSeek-V4's packed groups
    for pages in layers:
        page = pages.page_bytes
        part = rows.narrow(1, layer_start + pos * page, k * page).view(m, k, page)
        layer_start += bpc * page
        engine, part, dim = _paired_views(pages, part)
        if index is None:
            blocks = engine.narrow(dim, first_block, m * k).view(part.shape)
            if to_chunks:
                part.copy_(blocks)
            else:
                blocks.copy_(part)
        elif to_chunks:
            part.copy_(engine.index_select(dim, index).view(part.shape))
        else:
            engine.index_copy_(dim, index, part.flatten(dim, dim + 1))


def _paired_views(pages: LayerPages, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The engine's pages and the staging part in one shape, as 8-byte words where possible.

    ``part`` is ``[m, k, page]``; for a K/V-first layer it becomes ``[2, m, k,
    half]`` (a block's K half then V half in the chunk) against the engine's
    ``[2, num_blocks, half]``. Words instead of bytes let the copy kernels move
    eight times fewer elements.
    """
    engine = pages.pages
    dim = 0
    if pages.split is KVSplit.KV_FIRST:
        m, k, page = part.shape
        part = part.view(m, k, 2, page // 2).permute(2, 0, 1, 3)
        dim = 1
    if _word_viewable(engine) and _word_viewable(part):
        return engine.view(torch.int64), part.view(torch.int64), dim
    return engine, part, dim


def _word_viewable(t: torch.Tensor) -> bool:
    return (
        t.stride(-1) == 1
        and t.shape[-1] % _WORD == 0
        and t.storage_offset() % _WORD == 0
        and all(s % _WORD == 0 for s in t.stride()[:-1])
    )


def _host_copies(
    staging: torch.Tensor, chunks: Sequence[torch.Tensor], size: int, *, to_host: bool
) -> None:
    """Dense copies between staging rows and host chunk buffers: one per run of adjacent ones."""
    c = 0
    while c < len(chunks):
        base, end = chunks[c], c + 1
        while (
            end < len(chunks)
            and chunks[end].data_ptr() == base.data_ptr() + (end - c) * size
            and chunks[end].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        ):
            end += 1
        host = base.as_strided(((end - c) * size,), (1,), base.storage_offset())
        device = staging[c:end].view(-1)
        if to_host:
            host.copy_(device, non_blocking=True)
        else:
            device.copy_(host, non_blocking=True)
        c = end
