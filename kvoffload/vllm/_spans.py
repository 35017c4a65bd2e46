"""Turning chunks the index assigned into the :class:`ChunkSpan` s of an order.

One span per run of consecutive chunks of one group, so the worker moves each
run with one gather or scatter call per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvoffload.config.layout import CacheGroup
from kvoffload.messages import BlockSpan, ChunkSpan
from kvoffload.vllm._hits import needed_tokens

__all__ = ["NULL_BLOCK", "LoadPiece", "load_pieces", "load_spans", "store_spans"]

#: vLLM's placeholder block id for blocks a group does not hold (outside a window).
NULL_BLOCK = 0


class LoadPiece(NamedTuple):
    """One group's part of a load: engine blocks ``[first, stop)``, chunks from ``first_chunk``."""

    group: int
    first_chunk: int
    first: int
    stop: int
    keys: tuple[bytes, ...]


def load_pieces(
    groups: Sequence[CacheGroup],
    keys: Sequence[Sequence[bytes]],
    block_ids: Sequence[Sequence[int]],
    hit: tuple[int, int],
    blocks_per_chunk: int,
) -> list[LoadPiece]:
    """Per group, the engine blocks a hit fills and the chunks they lie in.

    ``hit`` is ``(local, stop)``: vLLM's own hit and the hit point; a group's
    blocks before what it needs, and null blocks, are not filled.
    """
    local, stop_token = hit
    pieces = []
    for g, group in enumerate(groups):
        blocks, tpb = block_ids[g], group.tokens_per_block
        first = needed_tokens(group, local, stop_token)[0] // tpb
        stop = min(-(-stop_token // tpb), len(blocks))
        while first < stop and blocks[first] == NULL_BLOCK:
            first += 1
        if first < stop:
            c0 = first // blocks_per_chunk
            chunk_keys = tuple(keys[g][c0 : -(-stop // blocks_per_chunk)])
            pieces.append(LoadPiece(g, c0, first, stop, chunk_keys))
    return pieces


def _runs(flags: Sequence[object]) -> list[tuple[int, int]]:
    """``[start, stop)`` of every run of equal consecutive ``flags``."""
    runs, start = [], 0
    while start < len(flags):
        stop = start + 1
        while stop < len(flags) and flags[stop] == flags[start]:
            stop += 1
        runs.append((start, stop))
        start = stop
    return runs


def load_spans(
    pieces: Sequence[LoadPiece],
    block_ids: Sequence[Sequence[int]],
    slots: Mapping[bytes, int],
    lost: set[bytes],
    blocks_per_chunk: int,
) -> tuple[tuple[ChunkSpan, ...], dict[int, tuple[int, ...]]]:
    """The spans of a load, and per group the engine blocks of chunks in ``lost`` (no slot)."""
    spans: list[ChunkSpan] = []
    unloadable: dict[int, tuple[int, ...]] = {}
    for piece in pieces:
        g, c0, keys, blocks = piece.group, piece.first_chunk, piece.keys, block_ids[piece.group]
        for start, run in _runs([key in lost for key in keys]):
            lo = max(piece.first, (c0 + start) * blocks_per_chunk)
            hi = min(piece.stop, (c0 + run) * blocks_per_chunk)
            if keys[start] in lost:
                unloadable[g] = unloadable.get(g, ()) + tuple(blocks[lo:hi])
                continue
            block_span = BlockSpan(tuple(blocks[lo:hi]), lo - (c0 + start) * blocks_per_chunk)
            chunk_slots = tuple(slots[key] for key in keys[start:run])
            spans.append(ChunkSpan(g, keys[start:run], chunk_slots, block_span))
    return tuple(spans), unloadable


def store_spans(
    chunks: Sequence[tuple[int, int, bytes, int]],
    block_ids: Sequence[Sequence[int]],
    blocks_per_chunk: int,
) -> tuple[ChunkSpan, ...]:
    """The spans of a store of ``(group, chunk, key, slot)`` s, sorted by group and chunk."""
    ordered = sorted(chunks)
    # A run continues while the group stays and the chunk index grows by one.
    flags = [(g, c - i) for i, (g, c, _, _) in enumerate(ordered)]
    spans = []
    for start, stop in _runs(flags):
        g, c = ordered[start][0], ordered[start][1]
        blocks = block_ids[g][c * blocks_per_chunk : (c + stop - start) * blocks_per_chunk]
        keys = tuple(key for _, _, key, _ in ordered[start:stop])
        slots = tuple(slot for _, _, _, slot in ordered[start:stop])
        spans.append(ChunkSpan(g, keys, slots, BlockSpan(tuple(blocks))))
    return tuple(spans)
