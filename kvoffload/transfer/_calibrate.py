"""DMA or kernel: which moves a call faster, measured per group and call size at start.

Neither path wins everywhere. The staged path (:mod:`._staged`) pays one
device kernel per layer plus one DMA per run of chunks, then moves dense
bytes at the copy engines' full rate; the kernel path (:mod:`._kernel`) pays
one launch, but its stores cross PCIe from the SMs, at a rate that depends on
the page size and on the GPU (peers measured batched DMA at 5-7 GB/s for 4-24
KiB pages on an H100 against 40-52 GB/s at 28 KiB and up). So the choice is
measured, not assumed: for every group (its own page sizes and layer count)
and call sizes of 1, 8 and 64 chunks, both directions, each path moves the
same chunks between scratch copies of the group's layers (a few blocks each,
never the engine's memory) and pinned host buffers; the faster one wins. A
call uses the row of the largest measured size not above its chunk count.

This runs only on CUDA and only with ``kernel="auto"``; it should take well
under a second on a GPU (not yet measured) and its table is logged once, at
the transfer's construction.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kvoffload.messages import BlockSpan
from kvoffload.transfer._kernel import KernelCopier
from kvoffload.transfer._staged import staged_copy
from kvoffload.transfer.views import KVSplit, LayerPages

__all__ = ["CALL_CHUNKS", "PathChoice", "calibrate"]

#: Chunks per call measured: one chunk, a store job's usual batch, a long load.
CALL_CHUNKS = (1, 8, 64)
#: Scratch bound per measurement (device and pinned host each): larger calls keep the row
#: of the largest size that fits.
MAX_SCRATCH_BYTES = 64 * 2**20
_REPEAT = 3


@dataclass(frozen=True, slots=True)
class PathChoice:
    """Measured seconds per call, ``[group][to_chunks][size]`` for ``(dma, kernel)``."""

    call_chunks: tuple[int, ...]
    seconds: tuple[tuple[tuple[tuple[float, float], ...], ...], ...]

    def use_kernel(self, group: int, to_chunks: bool, chunks: int) -> bool:
        rows = self.seconds[group][int(to_chunks)]
        i = max(0, bisect.bisect_right(self.call_chunks, chunks) - 1)
        dma, kernel = rows[min(i, len(rows) - 1)]
        return kernel < dma

    def summary(self) -> str:
        """One line per group: the winner and the speed-up at each measured call size."""
        lines = []
        for g, directions in enumerate(self.seconds):
            cells = []
            for name, rows in zip(("load", "store"), directions, strict=True):
                for n, (dma, kernel) in zip(self.call_chunks, rows, strict=False):
                    winner = "kernel" if kernel < dma else "dma"
                    cells.append(f"{name} x{n}: {winner} ({dma / kernel:.2f}x)")
            lines.append(f"group {g}: " + ", ".join(cells))
        return "; ".join(lines)


def _block_bytes(layers: Sequence[LayerPages]) -> int:
    """Device bytes a scratch block takes: packed pages keep their stride (DeepSeek-V4's
    1728-byte pages lie 95616 bytes apart), so this can be far more than the chunk's."""
    return sum(max(p.page_bytes, p.pages.stride(-2)) for p in layers)


def _scratch_layers(layers: Sequence[LayerPages], blocks: int) -> list[LayerPages]:
    """Device tensors with the layers' splits, pages and block strides, ``blocks`` long."""
    out = []
    for pages in layers:
        page, device = pages.page_bytes, pages.device
        if pages.split is KVSplit.KV_FIRST:
            view = torch.empty((2, blocks, page // 2), dtype=torch.uint8, device=device)
        else:
            stride = pages.pages.stride(0)  # padded and packed pages keep their spacing
            view = torch.empty_strided(
                (blocks, page), (stride, 1), dtype=torch.uint8, device=device
            )
        out.append(LayerPages(pages.name, pages.split, blocks, page, view))
    return out


def _best(fn: Callable[[], None], stream: torch.cuda.Stream | None) -> float:
    def run() -> None:
        if stream is None:
            fn()
            return
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()

    run()  # warm-up: Triton compiles, the caching allocator fills
    best = float("inf")
    for _ in range(_REPEAT):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _measure_group(
    layers: Sequence[LayerPages],
    bpc: int,
    chunk_bytes: int,
    call_chunks: Sequence[int],
    stream: torch.cuda.Stream | None,
) -> tuple[tuple[tuple[float, float], ...], ...]:
    directions: list[list[tuple[float, float]]] = [[], []]
    for n in call_chunks:
        if n > call_chunks[0] and n * bpc * _block_bytes(layers) > MAX_SCRATCH_BYTES:
            break
        scratch = _scratch_layers(layers, n * bpc)
        kernel = KernelCopier([scratch], [bpc])
        host = torch.zeros((n, chunk_bytes), dtype=torch.uint8, pin_memory=stream is not None)
        chunks = list(host.unbind(0))
        span = BlockSpan(tuple(range(n * bpc)))
        ids = np.arange(n * bpc, dtype=np.int64)
        for to_chunks in (False, True):
            dma = partial(
                staged_copy,
                scratch,
                span,
                ids,
                chunks,
                bpc,
                chunk_bytes,
                to_chunks=to_chunks,
                max_staging_bytes=MAX_SCRATCH_BYTES,
            )
            by_kernel = partial(kernel.copy, 0, span, ids, chunks, to_chunks=to_chunks)
            directions[int(to_chunks)].append((_best(dma, stream), _best(by_kernel, stream)))
    return tuple(tuple(rows) for rows in directions)


def calibrate(
    groups: Sequence[Sequence[LayerPages]],
    chunk_blocks: Sequence[int],
    chunk_bytes: Sequence[int],
    call_chunks: Sequence[int] = CALL_CHUNKS,
) -> PathChoice:
    """Time both paths on every group; see the module docstring.

    :class:`~kvoffload.transfer.KVTransfer` calibrates on CUDA only; on host
    tensors (the kernel in Triton's interpreter) this runs for the tests.
    """
    device = groups[0][0].device
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
    seconds = tuple(
        _measure_group(layers, bpc, size, call_chunks, stream)
        for layers, bpc, size in zip(groups, chunk_blocks, chunk_bytes, strict=True)
    )
    return PathChoice(tuple(call_chunks), seconds)
