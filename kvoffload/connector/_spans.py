"""Turning chunks the index assigned into the :class:`ChunkSpan` s of an order.

One span per run of consecutive chunks of one group, so the worker moves each
run with one gather or scatter call per layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvoffload.config.layout import CacheGroup, Reuse
from kvoffload.connector._hits import needed_tokens
from kvoffload.messages import BlockSpan, ChunkSpan

__all__ = [
    "NULL_BLOCK",
    "LoadPiece",
    "StorePiece",
    "load_pieces",
    "load_spans",
    "run_spans",
    "stateless",
    "store_spans",
]

#: vLLM's placeholder block id for blocks a group does not hold (outside a window).
NULL_BLOCK = 0


class LoadPiece(NamedTuple):
    """One group's part of a load: engine blocks ``[first, stop)``, chunks from ``first_chunk``."""

    group: int
    first_chunk: int
    first: int
    stop: int
    keys: tuple[bytes, ...]


def _runs(flags: Sequence[object]) -> list[tuple[int, int]]:
    """``[start, stop)`` of every run of equal consecutive ``flags``."""
    if flags and flags.count(flags[0]) == len(flags):  # one run (a load losing nothing), in C
        return [(0, len(flags))]
    runs, start = [], 0
    while start < len(flags):
        stop = start + 1
        while stop < len(flags) and flags[stop] == flags[start]:
            stop += 1
        runs.append((start, stop))
        start = stop
    return runs


def load_pieces(
    groups: Sequence[CacheGroup],
    keys: Sequence[Sequence[bytes]],
    block_ids: Sequence[Sequence[int]],
    bounds: tuple[int, int],
    blocks_per_chunk: int,
) -> list[LoadPiece]:
    """Per group, the engine blocks a hit at ``bounds = (local, hit)`` fills and their chunks.

    Null blocks before the first real one are vLLM's (outside a window); a
    state group's one block is kept even if null (see :func:`stateless`).
    """
    local, hit = bounds
    pieces = []
    for g, group in enumerate(groups):
        blocks, tpb = block_ids[g], group.tokens_per_block
        first = needed_tokens(group, local, hit)[0] // tpb
        stop = min(-(-hit // tpb), len(blocks))
        while first < stop and blocks[first] == NULL_BLOCK and group.reuse is not Reuse.STATE:
            first += 1
        if first < stop:
            c0 = first // blocks_per_chunk
            chunks = tuple(keys[g][c0 : -(-stop // blocks_per_chunk)])
            pieces.append(LoadPiece(g, c0, first, stop, chunks))
    return pieces


def stateless(
    pieces: Sequence[LoadPiece], groups: Sequence[CacheGroup], block_ids: Sequence[Sequence[int]]
) -> set[bytes]:
    """Keys of the states whose block vLLM left null: they have nowhere to go."""
    return {
        p.keys[0]
        for p in pieces
        if groups[p.group].reuse is Reuse.STATE and block_ids[p.group][p.first] == NULL_BLOCK
    }


def load_spans(
    pieces: Sequence[LoadPiece],
    block_ids: Sequence[Sequence[int]],
    slots: Mapping[bytes, int],
    lost: set[bytes],
    blocks_per_chunk: int,
    *,
    groups: Sequence[CacheGroup],
) -> tuple[tuple[ChunkSpan, ...], dict[int, tuple[int, ...]]]:
    """The spans of a load, and per group the engine blocks of chunks in ``lost`` (no slot)."""
    spans: list[ChunkSpan] = []
    unloadable: dict[int, tuple[int, ...]] = {}
    for piece in pieces:
        g, c0, keys, blocks = piece.group, piece.first_chunk, piece.keys, block_ids[piece.group]
        first_block = groups[g].chunk_first_block
        for start, run in _runs([key in lost for key in keys] if lost else [False] * len(keys)):
            # A tail's state (kvoffload.connector._tails) is in the block its hit ends at.
            first = min(first_block(c0 + start, blocks_per_chunk), piece.stop - 1)
            lo = max(piece.first, first)
            hi = min(piece.stop, (c0 + run) * blocks_per_chunk)
            if keys[start] in lost:
                unloadable[g] = unloadable.get(g, ()) + tuple(blocks[lo:hi])
                continue
            offset = lo - first
            block_span = BlockSpan(tuple(blocks[lo:hi]), offset)
            chunk_slots = tuple(map(slots.__getitem__, keys[start:run]))
            spans.append(ChunkSpan(g, keys[start:run], chunk_slots, block_span))
    return tuple(spans), unloadable


class StorePiece(NamedTuple):
    """One chunk of a store: its group and index, key, CPU slot and engine blocks."""

    group: int
    chunk: int
    key: bytes
    slot: int
    blocks: tuple[int, ...]


def store_spans(chunks: Sequence[StorePiece]) -> tuple[ChunkSpan, ...]:
    """The spans of a store, sorted by group and chunk."""
    ordered = sorted(chunks)
    # A run continues while the group stays and the chunk index grows by one.
    flags = [(p.group, p.chunk - i) for i, p in enumerate(ordered)]
    spans = []
    for start, stop in _runs(flags):
        run = ordered[start:stop]
        keys = tuple(p.key for p in run)
        slots = tuple(p.slot for p in run)
        blocks = tuple(b for p in run for b in p.blocks)
        spans.append(ChunkSpan(run[0].group, keys, slots, BlockSpan(blocks)))
    return tuple(spans)


def run_spans(
    group: int,
    chunks: Sequence[int],
    keys: Sequence[bytes],
    slots: Sequence[int],
    blocks: Sequence[int],
    *,
    blocks_per_chunk: int,
) -> tuple[ChunkSpan, ...]:
    """:func:`store_spans` for chunks of one group given in ascending order.

    ``chunks[i]`` (with ``keys[i]``, ``slots[i]``) has engine blocks
    ``blocks[chunks[i] * blocks_per_chunk :]``: a plain step's store, whose
    pieces need not be made one by one.
    """
    n = len(chunks)
    if not n:
        return ()
    if chunks[-1] - chunks[0] == n - 1:  # ascending, so no gap: one run, found at once
        cuts = [0, n]
    else:
        cuts = [0, *(i for i in range(1, n) if chunks[i] != chunks[i - 1] + 1), n]
    spans = []
    for start, stop in itertools.pairwise(cuts):
        ids = tuple(
            blocks[chunks[start] * blocks_per_chunk : (chunks[stop - 1] + 1) * blocks_per_chunk]
        )
        spans.append(
            ChunkSpan(group, tuple(keys[start:stop]), tuple(slots[start:stop]), BlockSpan(ids))
        )
    return tuple(spans)
