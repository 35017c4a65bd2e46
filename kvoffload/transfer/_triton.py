"""The Triton kernel of the kernel path (:mod:`._kernel`): every page of a call in one launch.

Imported only when the kernel path is asked for: Triton is not a dependency
of the core (vLLM's GPU installs bring it; ``pip install triton`` otherwise).

The kernel knows no layout. It reads two int64 tables: one row per *piece*
of a layer (a whole page, or the K or the V half of a K/V-first page; fixed
for a group) and one column per block of the call. Program ``(b, e, t)``
copies tile ``t`` of piece ``e`` of block ``b`` between

* the engine: ``base[e] + block_id[b] * block_stride[e]``, and
* the chunk:  ``chunk_addr[b] + chunk_offset[e] + slot[b] * slot_step[e]``

as words of ``WORD`` (the widest integer every address and size divides
into). Addresses are raw: on CUDA the chunk side is pinned host memory that
the GPU reads and writes through unified addressing (no staging, no DMA);
on host tensors the kernel runs in Triton's interpreter, the same one
``TRITON_INTERPRET=1`` selects, which the tests use to check it bit for bit
on machines without a GPU.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["PIECE_FIELDS", "launch"]

#: Columns of the piece table, in order.
PIECE_FIELDS = ("base", "block_stride", "nbytes", "chunk_offset", "slot_step")

_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


def _copy_pages(  # type: ignore[no-untyped-def]  # noqa: PLR0917 - the launch ABI
    pieces,  # [n_pieces, 5] int64: PIECE_FIELDS
    blocks,  # [3, n_blocks] int64: block id, chunk address, slot in the chunk
    n_blocks,
    WORD: tl.constexpr,
    WORD_BYTES: tl.constexpr,
    TILE: tl.constexpr,
    TO_CHUNKS: tl.constexpr,
    ALIGNED16: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.program_id(1)
    t = tl.program_id(2)
    row = pieces + e * 5
    engine = tl.load(row) + tl.load(blocks + b) * tl.load(row + 1)
    host = tl.load(blocks + n_blocks + b) + tl.load(row + 3)
    host += tl.load(blocks + 2 * n_blocks + b) * tl.load(row + 4)
    words = tl.load(row + 2) // WORD_BYTES
    offsets = t * TILE + tl.arange(0, TILE)
    mask = offsets < words
    if TO_CHUNKS:
        src = engine.to(tl.pointer_type(WORD))
        dst = host.to(tl.pointer_type(WORD))
    else:
        src = host.to(tl.pointer_type(WORD))
        dst = engine.to(tl.pointer_type(WORD))
    if ALIGNED16:  # 16-byte loads and stores (checked on sm_90's PTX: v2.b64)
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        mask = offsets < tl.multiple_of(words, 2)
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


_compiled: Any = triton.jit(_copy_pages)
_interpreted: Any = InterpretedFunction(_copy_pages)
# The interpreter patches triton.language while a grid runs: one grid at a time.
_interpreter_lock = threading.Lock()


def launch(  # noqa: PLR0917 - private helper, called positionally by the kernel path
    pieces: torch.Tensor,
    blocks: torch.Tensor,
    grid: tuple[int, int, int],
    word: int,
    tile: int,
    to_chunks: bool,
    aligned16: bool,
) -> None:
    """One launch on the current stream (CUDA), or one interpreted grid (host tensors).

    ``aligned16``: every address and size is a multiple of 16 bytes, ``word`` is 8.
    """
    args = (pieces, blocks, blocks.shape[1])
    meta = {
        "WORD": _WORDS[word],
        "WORD_BYTES": word,
        "TILE": tile,
        "TO_CHUNKS": to_chunks,
        "ALIGNED16": aligned16,
    }
    if pieces.device.type == "cuda":
        # No floating point here; naming the option keeps Triton 3.9 from warning on its default.
        _compiled[grid](*args, **meta, enable_fp_fusion=False)
        return
    with _interpreter_lock:
        _interpreted[grid](*args, **meta)
