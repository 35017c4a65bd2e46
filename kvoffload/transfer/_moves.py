"""The copy primitives behind :class:`kvoffload.transfer.KVTransfer`: one call per layer per run.

Measured on the project's CPU host (out of cache, one thread): a narrow
``copy_`` and ``torch.index_select(out=)`` run at memcpy speed, numpy's
fancy row assignment too, but ``Tensor.index_copy_`` / ``index_put_`` on
``uint8`` rows fall to a few percent of it. So CPU scatters of scattered
blocks go through numpy views of the same memory, and nothing here calls
``index_copy_`` except on CUDA, where it is a device kernel.
"""

from __future__ import annotations

import torch

from kvoffload.transfer.views import KVSplit, LayerPages

__all__ = ["copy_blocks", "copy_strided_run"]


def copy_strided_run(
    pages: LayerPages,
    first_buffer: torch.Tensor,
    step: int,
    layer_offset: int,
    first_block: int,
    shape: tuple[int, int],
    *,
    to_chunks: bool,
) -> None:
    """Copy ``m`` whole chunks of consecutive blocks with one strided copy.

    ``shape`` is ``(m, blocks_per_chunk)``; chunk ``i`` of the run starts
    ``i * step`` bytes after ``first_buffer`` (slots of one slab), and this
    layer's bytes start ``layer_offset`` bytes into each chunk.
    """
    m, bpc = shape
    page = pages.page_bytes
    offset = first_buffer.storage_offset() + layer_offset
    cuda = pages.pages.device.type == "cuda"
    if pages.split is KVSplit.KV_FIRST:
        half = page // 2
        dst = first_buffer.as_strided((m, bpc, 2, half), (step, page, half, 1), offset)
        src = pages.pages.narrow(1, first_block, m * bpc).unflatten(1, (m, bpc))
        src = src.permute(1, 2, 0, 3)
    else:
        dst = first_buffer.as_strided((m, bpc, page), (step, page, 1), offset)
        src = pages.pages.narrow(0, first_block, m * bpc).unflatten(0, (m, bpc))
    if to_chunks:
        dst.copy_(src, non_blocking=cuda)
    else:
        src.copy_(dst, non_blocking=cuda)


def copy_blocks(
    pages: LayerPages,
    part: torch.Tensor,
    first_block: int,
    index: torch.Tensor | None,
    *,
    to_chunks: bool,
    keep: list[torch.Tensor],
) -> None:
    """Copy between the engine blocks and ``part`` (``[n, page]`` bytes of one chunk).

    ``index`` is ``None`` when the blocks are consecutive from ``first_block``.
    ``keep`` collects CUDA temporaries that must outlive the stream's work.
    """
    engine, dim = pages.pages, 0
    if pages.split is KVSplit.KV_FIRST:
        part, dim = part.unflatten(1, (2, -1)).transpose(0, 1), 1  # [2, n, half] like the engine
    cuda = engine.device.type == "cuda"
    if index is None:
        blocks = engine.narrow(dim, first_block, part.shape[dim])
        if to_chunks:
            part.copy_(blocks, non_blocking=cuda)
        else:
            blocks.copy_(part, non_blocking=cuda)
    elif not cuda:
        if to_chunks:
            torch.index_select(engine, dim, index, out=part)
        elif dim == 0:
            engine.numpy()[index.numpy()] = part.numpy()
        else:
            engine.numpy()[:, index.numpy()] = part.numpy()
    elif to_chunks:
        staged = engine.index_select(dim, index)
        keep.append(staged)
        part.copy_(staged, non_blocking=True)
    else:
        staged = part.to(engine.device, non_blocking=True)
        keep.append(staged)
        engine.index_copy_(dim, index, staged)
