"""The copy primitive behind :class:`kvoffload.transfer.KVTransfer`: one call per layer per run.

A *run* is ``m`` chunks of ``k`` blocks each whose bytes for one layer sit at
a fixed step in memory (``dst``: ``[m, k, page]``; one chunk, or evenly spaced
slots of one slab). :func:`move_span` splits a span into runs (the direct path,
for host tensors and ``staged=False``); :func:`move_run` moves one. Measured on
the project's CPU host (out of cache, one thread), against ``np.copyto`` of the
same bytes:

* a consecutive run is one ``np.copyto`` between numpy views of the same
  memory (torch's ``copy_`` measured ~10% slower);
* a gather of scattered blocks is ``torch.index_select(out=)`` (75-90%);
  ``np.take(out=)`` runs at ~20%, so it is not used;
* a scatter of scattered blocks is one numpy fancy assignment (~95%);
  ``Tensor.index_copy_`` / ``index_put_`` on ``uint8`` rows run at 2-3%, so
  they are used only on CUDA, where they are device kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.messages import BlockSpan
from kvoffload.transfer.views import KVSplit, LayerPages

__all__ = ["move_run", "move_span"]


def move_span(
    layers: Sequence[LayerPages],
    span: BlockSpan,
    ids: npt.NDArray[np.int64],
    chunks: Sequence[torch.Tensor],
    *,
    bpc: int,
    size: int,
    to_chunks: bool,
) -> None:
    """Move ``layers``' blocks ``ids`` of ``span`` between the engine and ``chunks`` (of
    ``bpc`` blocks, ``size`` bytes each): the span split into runs, one copy per layer per run."""
    ranges = span.chunk_ranges(bpc)
    c = 0
    while c < len(ranges):
        m, step = _mergeable(chunks, ranges, c, bpc, size)
        start, stop, pos = ranges[c]
        stop = ranges[c + m - 1][1]
        run = ids[start:stop]
        index = None if bool((np.diff(run) == 1).all()) else run.reshape(m, -1)
        k = (stop - start) // m
        layer_start = 0  # layers' pages differ in size in DeepSeek-V4's packed groups
        for layer in layers:
            offset = layer_start + pos * layer.page_bytes
            layer_start += bpc * layer.page_bytes
            base = chunks[c]
            dst = base.as_strided(
                (m, k, layer.page_bytes),
                (step, layer.page_bytes, 1),
                base.storage_offset() + offset,
            )
            move_run(layer, dst, int(run[0]), index, to_chunks=to_chunks)
        c += m


def _mergeable(
    chunks: Sequence[torch.Tensor],
    ranges: Sequence[tuple[int, int, int]],
    c: int,
    bpc: int,
    size: int,
) -> tuple[int, int]:
    """How many chunks from ``c`` one copy per layer can move, and their buffer step in bytes.

    They must be whole chunks whose buffers lie evenly spaced, without
    overlap, in one storage (slots of one slab, typically). A partial chunk
    (the first of an unaligned load, the last of a span) is a run by itself.
    """

    def whole(i: int) -> bool:
        return BlockSpan.is_whole(ranges[i], bpc)

    single = (1, size)
    if c + 1 >= len(ranges) or not whole(c):
        return single
    base = chunks[c]
    step = chunks[c + 1].data_ptr() - base.data_ptr()
    if step < size:
        return single
    storage = base.untyped_storage().data_ptr()
    m = 1
    while (
        c + m < len(ranges)
        and whole(c + m)
        and chunks[c + m].data_ptr() - chunks[c + m - 1].data_ptr() == step
        and chunks[c + m].untyped_storage().data_ptr() == storage
    ):
        m += 1
    return (m, step) if m > 1 else single


def _engine_side(pages: LayerPages, dst: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``dst`` reshaped like the engine tensor, and the engine's block dimension."""
    if pages.split is KVSplit.KV_FIRST:
        m, k, page = dst.shape
        return dst.view(m, k, 2, page // 2).permute(2, 0, 1, 3), 1  # [2, m, k, half]
    return dst, 0


def move_run(
    pages: LayerPages,
    dst: torch.Tensor,
    first_block: int,
    index: npt.NDArray[np.int64] | None,
    *,
    to_chunks: bool,
) -> None:
    """Copy one layer's blocks between the engine and ``dst`` (``[m, k, page]`` chunk bytes).

    ``index`` (``[m, k]``) names the engine blocks, or is ``None`` when they
    are consecutive from ``first_block``.
    """
    m, k, _ = dst.shape
    part, dim = _engine_side(pages, dst)
    engine = pages.pages
    if engine.device.type == "cuda":
        _move_cuda(engine, dim, part, first_block, index, to_chunks=to_chunks)
    elif index is None:
        shape = (2, m, k, -1) if dim else (m, k, -1)
        blocks = engine.narrow(dim, first_block, m * k).view(shape).numpy()
        if to_chunks:
            np.copyto(part.numpy(), blocks)
        else:
            np.copyto(blocks, part.numpy())
    elif not to_chunks:
        target = engine.numpy()
        if dim:
            target[:, index] = part.numpy()
        else:
            target[index] = part.numpy()
    elif m <= k:  # one index_select per chunk, into its contiguous bytes
        for c in range(m):
            out = part[:, c] if dim else part[c]
            torch.index_select(engine, dim, torch.from_numpy(index[c]), out=out)
    else:  # one per position inside the chunks, into a strided view
        for j in range(k):
            out = part[:, :, j] if dim else part[:, j]
            torch.index_select(engine, dim, torch.from_numpy(index[:, j].copy()), out=out)


def _move_cuda(
    engine: torch.Tensor,
    dim: int,
    part: torch.Tensor,
    first_block: int,
    index: npt.NDArray[np.int64] | None,
    *,
    to_chunks: bool,
) -> None:
    """The same straight between a CUDA tensor and host memory (``KVTransfer(staged=False)``).

    Strided host copies go through torch's pageable temporaries, so this is
    kept as the reference the staged path (:mod:`._staged`) is measured against.
    Temporaries are allocated on the caller's stream, which it synchronises.
    """
    shape = part.shape
    if index is None:
        blocks = engine.narrow(dim, first_block, shape[dim] * shape[dim + 1]).view(shape)
        if to_chunks:
            part.copy_(blocks, non_blocking=True)
        else:
            blocks.copy_(part, non_blocking=True)
        return
    flat = torch.from_numpy(index.reshape(-1)).to(engine.device, non_blocking=True)
    if to_chunks:
        part.copy_(engine.index_select(dim, flat).view(shape), non_blocking=True)
    else:
        engine.index_copy_(
            dim, flat, part.to(engine.device, non_blocking=True).flatten(dim, dim + 1)
        )
