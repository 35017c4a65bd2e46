"""Chunks moved between the engine's blocks and their CPU slots, counted where they move.

A store copies a span's engine blocks into its reserved CPU slots
(:meth:`ChunkCopier.gather`), and only then binds them to their keys and
writes them through to the lower tiers (:meth:`ChunkCopier.commit`): the
engine may reuse its blocks in between.

A load makes each chunk hold its key in its CPU slot first (already there, or
read and checksum-verified from a lower tier into it), then copies the chunks
that passed into the engine, one call per run of consecutive verified chunks.
A load job does both at once (:meth:`ChunkCopier.load`); a load in the step
verifies every chunk first and then copies run by run, layer by layer
(:mod:`._layered`). Either way a run that failed reports every engine block of
its chunks, so the engine recomputes exactly those.

The slab's counters take every copy here (each lower tier counts its own I/O),
and the fault points (``KVOFFLOAD_FAILPOINTS``) fire here, on the copies they
damage (and on the lower-tier reads ``load.slow_lower`` slows).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from kvoffload.engine._outcome import Outcome
from kvoffload.engine.failpoints import FailPoints
from kvoffload.messages import BlockSpan, ChunkSpan
from kvoffload.tiers.cascade import TierCascade
from kvoffload.transfer import KVTransfer

__all__ = ["ChunkCopier", "Run"]


@dataclass(slots=True)
class Run:
    """Chunks ``[start, stop)`` of ``span``, all verified (``ok``) or all failed."""

    span: ChunkSpan
    start: int
    stop: int
    ok: bool


class ChunkCopier:
    """Copies chunks between ``transfer``'s engine tensors and ``cascade``'s CPU slots.

    ``faults`` is None unless fault points are on: then each check costs one test.
    """

    def __init__(
        self, transfer: KVTransfer, cascade: TierCascade, faults: FailPoints | None
    ) -> None:
        self.transfer = transfer
        self.cascade = cascade
        self.faults = faults

    # -- stores ---------------------------------------------------------------------
    def gather(self, span: ChunkSpan, after: torch.cuda.Event | None, outcome: Outcome) -> bool:
        """Copy the span's engine blocks into its reserved CPU slots; ``False`` if that failed."""
        cpu, nbytes = self.cascade.cpu, self.transfer.chunk_bytes(span.group)
        for slot in span.slots:
            cpu.reserve(slot)
        start = time.perf_counter()
        try:
            buffers = [cpu.slot(slot, nbytes) for slot in span.slots]
            if self.faults is None or not self.faults.drops_store():
                self.transfer.gather(span.group, span.blocks, buffers, after=after)
        except Exception as exc:  # reported per chunk below; the slots hold nothing
            for slot in span.slots:
                cpu.release(slot)
            cpu.counters.add(store_failures=len(span.keys))
            outcome.failed.extend(span.keys)
            outcome.errors.append(f"transfer: group {span.group}: {exc}")
            return False
        moved = nbytes * len(span.keys)
        seconds = time.perf_counter() - start
        cpu.counters.add(stores=len(span.keys), store_bytes=moved, store_seconds=seconds)
        outcome.nbytes += moved
        return True

    def commit(self, span: ChunkSpan, outcome: Outcome) -> None:
        """Bind the gathered chunks to their keys and write them through to lower tiers."""
        cpu, nbytes = self.cascade.cpu, self.transfer.chunk_bytes(span.group)
        for key, slot in zip(span.keys, span.slots, strict=True):
            cpu.bind(key, slot, nbytes)
            outcome.errors.extend(self.cascade.write_through(key, slot, nbytes))
            outcome.done.append(key)

    # -- loads ----------------------------------------------------------------------
    def load(self, span: ChunkSpan, after: torch.cuda.Event | None, outcome: Outcome) -> None:
        """Verify and copy one span whole (a load job on the pool, or every layer at once)."""
        runs = self.verified_runs(span, outcome)
        for run in runs:
            run.ok = run.ok and self.scatter(run, after, outcome)
        self.settle(runs, outcome)

    def promote(
        self, span: ChunkSpan, outcome: Outcome, before_read: Callable[[], None] | None = None
    ) -> None:
        """Make each chunk of ``span`` hold its key in its CPU slot, verified, and no more;
        ``before_read`` is called before each chunk is read (a promotion's wait for loads)."""
        for run in self.verified_runs(span, outcome, before_read):
            keys = span.keys[run.start : run.stop]
            (outcome.done if run.ok else outcome.failed).extend(keys)

    def verified_runs(
        self, span: ChunkSpan, outcome: Outcome, before_read: Callable[[], None] | None = None
    ) -> list[Run]:
        """Each chunk of ``span`` made to hold its key in its slot, in runs of one verdict."""
        nbytes = self.transfer.chunk_bytes(span.group)
        ok = []
        for key, slot in zip(span.keys, span.slots, strict=True):
            if before_read is not None:
                before_read()
            why: list[str] = []
            started = time.perf_counter()
            source = self.cascade.fill(key, slot, nbytes, why)
            ok.append(source is not None)
            if source is not None and source is not self.cascade.cpu:
                outcome.promoted.append(key)
                if self.faults is not None:  # load.slow_lower: a read from a slow tier
                    self.faults.slow_read(nbytes, started)
            if source is None:
                detail = "; ".join(why) or "no tier holds it"
                outcome.errors.append(f"no tier could load chunk {key.hex()[:16]} ({detail})")
        if ok[-1] and self.faults is not None and self.faults.fails_load():
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

    def scatter(
        self,
        run: Run,
        after: torch.cuda.Event | None,
        outcome: Outcome,
        layer: int | None = None,
    ) -> bool:
        """Copy a verified run into the engine (``layer``: that layer only); ``False`` if it failed.

        The run's chunks are counted once: on the whole copy, or on the copy
        of the group's last layer.
        """
        last_layer = len(self.transfer.groups[run.span.group]) - 1
        chunks = run.stop - run.start if layer in (None, last_layer) else 0
        return self._scatter(run, after, outcome, layer, chunks)

    def scatter_last_into(
        self, run: Run, block: int, after: torch.cuda.Event | None, outcome: Outcome
    ) -> bool:
        """Copy the run's last chunk into one more engine ``block`` too; ``False`` if it failed.

        A recurrent state goes into its own block by :meth:`scatter` and into
        the block the request's state runs in by this copy; its chunk was
        counted by the first, so this one counts bytes only.
        """
        span = run.span
        last = ChunkSpan(span.group, span.keys[-1:], span.slots[-1:], BlockSpan((block,)))
        return self._scatter(Run(last, 0, 1, ok=True), after, outcome, None, chunks=0)

    def settle(self, runs: list[Run], outcome: Outcome) -> None:
        """Record each run's verdict: its keys done, or its keys and engine blocks failed."""
        for run in runs:
            keys = run.span.keys[run.start : run.stop]
            if run.ok:
                outcome.done.extend(keys)
                continue
            outcome.failed.extend(keys)
            ranges = run.span.blocks.chunk_ranges(self.transfer.chunk_blocks(run.span.group))
            blocks = run.span.blocks.block_ids[ranges[run.start][0] : ranges[run.stop - 1][1]]
            outcome.failed_blocks.setdefault(run.span.group, []).extend(blocks)

    def _scatter(
        self,
        run: Run,
        after: torch.cuda.Event | None,
        outcome: Outcome,
        layer: int | None,
        chunks: int,
    ) -> bool:
        """Copy ``run`` and count it in the slab: its bytes and seconds, and ``chunks`` loads."""
        span, transfer, cpu = run.span, self.transfer, self.cascade.cpu
        bpc, nbytes = transfer.chunk_blocks(span.group), transfer.chunk_bytes(span.group)
        sub = span.blocks.sub(run.start, run.stop, bpc)
        layers = transfer.groups[span.group]
        begin = time.perf_counter()
        try:
            buffers = [cpu.slot(slot, nbytes) for slot in span.slots[run.start : run.stop]]
            scatter = partial(transfer.scatter, after=after, layer=layer)
            if self.faults is None or layer not in (None, 0):  # a fault fires once a run
                scatter(span.group, sub, buffers)
            else:
                self.faults.scatter(scatter, bpc, span.group, sub, buffers)
        except Exception as exc:  # the engine recomputes these blocks
            cpu.counters.add(load_failures=run.stop - run.start)
            outcome.errors.append(f"transfer: group {span.group}: {exc}")
            return False
        pages = layers if layer is None else layers[layer : layer + 1]
        moved = len(sub.block_ids) * sum(p.page_bytes for p in pages)
        seconds = time.perf_counter() - begin
        cpu.counters.add(loads=chunks, load_bytes=moved, load_seconds=seconds)
        outcome.nbytes += moved
        return True
