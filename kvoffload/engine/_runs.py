"""A load's chunks in runs: verified in their CPU slots first, then scattered to the engine.

A load makes each chunk hold its key in its CPU slot (already there, or read
and checksum-verified from a lower tier into it), then copies the chunks that
passed into the engine, one call per run of consecutive verified chunks. A
whole load does both at once (:func:`load_span`); a load in the step verifies
every chunk first and then copies run by run, layer by layer
(:mod:`._layered`). Either way a run that failed reports every engine block of
its chunks, so the engine recomputes exactly those.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from kvoffload.engine._outcome import Outcome
from kvoffload.messages import ChunkSpan

if TYPE_CHECKING:
    from kvoffload.engine.engine import OffloadEngine

__all__ = ["Run", "load_span", "promote_span", "scatter_run", "settle", "verified_runs"]


@dataclass(slots=True)
class Run:
    """Chunks ``[start, stop)`` of ``span``, all verified (``ok``) or all failed."""

    span: ChunkSpan
    start: int
    stop: int
    ok: bool


def verified_runs(engine: OffloadEngine, span: ChunkSpan, outcome: Outcome) -> list[Run]:
    """Make each chunk of ``span`` hold its key in its slot; the chunks in runs of one verdict."""
    nbytes = engine.transfer.chunk_bytes(span.group)
    ok = []
    for key, slot in zip(span.keys, span.slots, strict=True):
        why: list[str] = []
        source = engine.cascade.fill(key, slot, nbytes, why)
        ok.append(source is not None)
        if source is not None and source is not engine.cascade.cpu:
            outcome.promoted.append(key)
        if source is None:
            detail = "; ".join(why) or "no tier holds it"
            outcome.errors.append(f"no tier could load chunk {key.hex()[:16]} ({detail})")
    if ok[-1] and engine.faults is not None and engine.faults.fails_load():
        ok[-1] = False
        outcome.errors.append("fault point load.fail_last_chunk: the last chunk failed")
    runs, start = [], 0
    while start < len(ok):
        stop = start + 1
        while stop < len(ok) and ok[stop] == ok[start]:
            stop += 1
        runs.append(Run(span, start, stop, ok[start]))
        start = stop
    return runs


def scatter_run(
    engine: OffloadEngine,
    run: Run,
    after: torch.cuda.Event | None,
    outcome: Outcome,
    layer: int | None = None,
    *,
    counted: bool = False,
) -> bool:
    """Copy a verified run into the engine (``layer``: that layer only); ``False`` if it failed.

    The slab's counters take the bytes and seconds of every call, and the
    chunks once: on the whole copy, or on the group's last layer, unless
    they were ``counted`` already (a second copy of the same chunks).
    """
    span, transfer, cpu = run.span, engine.transfer, engine.cascade.cpu
    bpc, nbytes = transfer.chunk_blocks(span.group), transfer.chunk_bytes(span.group)
    sub = span.blocks.sub(run.start, run.stop, bpc)
    layers = transfer.groups[span.group]
    begin = time.perf_counter()
    try:
        buffers = [cpu.slot(slot, nbytes) for slot in span.slots[run.start : run.stop]]
        scatter = partial(transfer.scatter, after=after, layer=layer)
        if engine.faults is None or layer not in (None, 0):  # a fault fires once a run
            scatter(span.group, sub, buffers)
        else:
            engine.faults.scatter(scatter, bpc, span.group, sub, buffers)
    except Exception as exc:  # the engine recomputes these blocks
        cpu.counters.add(load_failures=run.stop - run.start)
        outcome.errors.append(f"transfer: group {span.group}: {exc}")
        return False
    pages = layers if layer is None else layers[layer : layer + 1]
    moved = len(sub.block_ids) * sum(p.page_bytes for p in pages)
    chunks = run.stop - run.start if layer in (None, len(layers) - 1) and not counted else 0
    cpu.counters.add(loads=chunks, load_bytes=moved,
                     load_seconds=time.perf_counter() - begin)  # fmt: skip
    outcome.nbytes += moved
    return True


def settle(runs: list[Run], outcome: Outcome, bpc_of: dict[int, int]) -> None:
    """Record each run's verdict: its keys done, or its keys and engine blocks failed."""
    for run in runs:
        keys = run.span.keys[run.start : run.stop]
        if run.ok:
            outcome.done.extend(keys)
            continue
        outcome.failed.extend(keys)
        ranges = run.span.blocks.chunk_ranges(bpc_of[run.span.group])
        blocks = run.span.blocks.block_ids[ranges[run.start][0] : ranges[run.stop - 1][1]]
        outcome.failed_blocks.setdefault(run.span.group, []).extend(blocks)


def load_span(
    engine: OffloadEngine, span: ChunkSpan, after: torch.cuda.Event | None, outcome: Outcome
) -> None:
    """Verify and copy one span whole (a load job on the pool, or every layer at once)."""
    runs = verified_runs(engine, span, outcome)
    for run in runs:
        run.ok = run.ok and scatter_run(engine, run, after, outcome)
    settle(runs, outcome, {span.group: engine.transfer.chunk_blocks(span.group)})


def promote_span(engine: OffloadEngine, span: ChunkSpan, outcome: Outcome) -> None:
    """Make each chunk of ``span`` hold its key in its CPU slot, verified; copy nothing further."""
    for run in verified_runs(engine, span, outcome):
        keys = span.keys[run.start : run.stop]
        (outcome.done if run.ok else outcome.failed).extend(keys)
