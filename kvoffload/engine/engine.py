"""The worker side: asynchronous store and load jobs between engine KV and the tiers.

``OffloadEngine`` is what a vLLM worker-side connector drives: it submits
jobs and returns their ids at once, runs them on a few threads (tiers are
synchronous; copies and file I/O release the GIL), and reports each one
once through :meth:`OffloadEngine.get_finished`.

What a job is given comes from the scheduler-side index: chunk keys and the
CPU slots ``prepare_store`` / ``prepare_load`` assigned, per group, with the
engine blocks they map to (:class:`ChunkSpan`). The engine never decides what
to evict; it moves bytes and reports.

Guarantees:

* **No races per chunk, no waits across chunks.** A job holds the job locks of
  its keys and slots: a store and a load of the same chunk or slot run one
  after the other, in the order they were submitted, whatever the submitting
  threads do, and jobs of other chunks and slots never wait for them
  (:mod:`._locks`: how, and why jobs never deadlock).
* **Loads are verified before they reach the engine** (invariant 3). Each
  chunk is made to hold its key in its CPU slot first (already there, or
  read and checksum-verified from a lower tier into it); only chunks that
  passed are scattered. Every block of a chunk that failed is reported in
  ``JobResult.failed_blocks``, so the engine recomputes exactly those.
* **Failed stores are reported** in their ``JobResult``, never swallowed.
  Stores cover whole chunks; lower-tier write failures are reported in
  ``JobResult.errors`` without failing the store (see :mod:`kvoffload.tiers.cascade`).
* **Counted once, by the tiers.** The engine times its copies into and out of
  the CPU slab and records them in the slab's counters; every lower tier counts
  its own I/O. :meth:`stats` returns one record per tier; jobs are reported,
  not counted, here (the connector's worker side counts them from the reports).
* **Engine blocks are free again early, whatever the lower tiers do.** A store
  job copies all its blocks into CPU slots first, then writes lower tiers;
  :meth:`wait_for_sources` returns once every submitted store is past the
  copy, so a connector can let the engine reuse those blocks without waiting
  for disk or network. That copy never queues behind a lower-tier read or
  write of other chunks (the threads below); it waits only for earlier jobs of
  its own chunks or slots.
* **CUDA.** A job records an event on the submitting thread's current
  stream; its copies wait on that event on the job thread's own stream (a
  store so that it copies the KV the forward pass wrote, a load so that it
  never overwrites blocks a queued kernel still uses), and the host waits for
  that stream only, never the engine's.

Threads. A job starts on the threads of its kind once its locks are free; it
waits for them on none (:mod:`._locks`). The kinds have threads of their own,
a fixed number in all, so that the copies the engine waits for never queue
behind lower-tier I/O, nor the loads a running request waits for behind a
promotion:

* one *copy* thread: a store's copy out of the engine's blocks, and nothing
  that touches a lower tier. One, because the copies are memory-bound and
  short, and more would take cores from the forward pass;
* ``max_workers`` (2) *job* threads: loads, and stores' writes to the lower
  tiers once their copy is done. Two keep a disk write and a read in flight
  at once without oversubscribing the host;
* one *promotion* thread: reads of lower-tier chunks into the CPU tier for
  requests that still wait in the engine's queue (:meth:`OffloadEngine.submit_promote`).
  One, because they read the same disk one after the other anyway. Before each chunk
  it waits until no load job runs: a load is for a request the engine has scheduled,
  whose blocks are allocated and whose first token waits on it, so a fetch ahead
  reads with the bandwidth the loads leave instead of taking it from them (on a slow
  drive the two would share it: docs/benchmarks.md, "A lower tier behind a small CPU
  tier, and a queue").

Loads in the step run on none of these but on the forward pass's thread (and
the copy thread of :mod:`._layered`); they too wait only for earlier jobs of
their own chunks. The remote tier is written on its queue's own thread
(:mod:`kvoffload.tiers.cascade`).

Inside, a job on the threads and a load in the step share two parts, each
handed only what it needs, so that neither reaches back into the engine:
the job book (:mod:`._book`: ids, locks, the counts the waits read) and the
chunk copier (:mod:`._copier`: transfer, tiers, fault points). Loads in the
step start through :mod:`._layered`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from kvoffload.config import OffloadConfig
from kvoffload.engine._book import Held, JobBook
from kvoffload.engine._copier import ChunkCopier
from kvoffload.engine._layered import CopyMode, LayeredLoad, LayeredLoader
from kvoffload.engine._outcome import Outcome
from kvoffload.engine.failpoints import FailPoints
from kvoffload.errors import TransferError
from kvoffload.messages import ChunkSpan, JobKind, JobResult
from kvoffload.tiers.base import Tier
from kvoffload.tiers.cascade import TierCascade
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.from_config import lower_tiers
from kvoffload.tiers.stats import TierStats
from kvoffload.transfer import KVTransfer

__all__ = ["OffloadEngine"]


@dataclass(slots=True)
class _Job:
    """One submitted job, from its thread to the next (a store's copy, then its writes)."""

    job_id: int
    kind: JobKind
    spans: tuple[ChunkSpan, ...]
    after: torch.cuda.Event | None
    submitted: float
    outcome: Outcome = field(default_factory=Outcome)
    held: Held | None = None  # its job locks, once it may start


class OffloadEngine:
    """Submits store/load jobs between ``transfer``'s engine tensors and ``cascade``.

    ``max_workers``: the job threads, which run loads and stores' lower-tier
    writes (the module docstring's "Threads").
    """

    def __init__(self, transfer: KVTransfer, cascade: TierCascade, *, max_workers: int = 2) -> None:
        #: Fault points (``KVOFFLOAD_FAILPOINTS``), read once here; None, the rule, costs nothing.
        self.faults = FailPoints.from_env()
        self.transfer = transfer
        self.cascade = cascade
        self._copier = ChunkCopier(transfer, cascade, self.faults)
        self._book = JobBook()
        self._layered = LayeredLoader(self._copier, self._book)
        # The module docstring's "Threads": each kind of work on its own, a fixed number.
        self._copies = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-copy")
        self._jobs = ThreadPoolExecutor(max_workers, thread_name_prefix="kvoffload")
        self._promotions = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-promote")
        self._closed = False

    @classmethod
    def create(
        cls,
        transfer: KVTransfer,
        cpu: CPUSlab,
        lower: Sequence[Tier] = (),
        *,
        max_workers: int = 2,
    ) -> OffloadEngine:
        """An engine over a CPU slab and lower tiers (disk, ...), in cascade order."""
        return cls(transfer, TierCascade(cpu, lower), max_workers=max_workers)

    @classmethod
    def from_config(
        cls,
        config: OffloadConfig,
        kv_caches: Mapping[str, torch.Tensor],
        namespace: bytes,
        *,
        max_workers: int = 2,
    ) -> OffloadEngine:
        """The engine a validated configuration describes: CPU slab, then disk and remote tiers.

        ``namespace`` fingerprints model, dtype and layout
        (:func:`kvoffload.keys.namespace_of`); the disk tier keeps its files under it.
        The remote tier is written behind the store jobs, from a queue of at most
        ``remote_queue_bytes`` (see :mod:`kvoffload.tiers.cascade`).
        """
        transfer = KVTransfer(
            config.layout, kv_caches, config.blocks_per_chunk, kernel=config.transfer_kernel
        )
        # Pinned only for GPU KV: pinning is what makes device copies asynchronous DMA.
        cpu = CPUSlab(config.num_cpu_chunks, config.max_chunk_bytes, pin_memory=transfer.is_cuda)
        cascade = TierCascade(cpu, lower_tiers(config, namespace))
        return cls(transfer, cascade, max_workers=max_workers)

    # -- the worker-side interface -------------------------------------------------
    def submit_store(self, spans: Sequence[ChunkSpan]) -> int:
        """Queue a store of whole chunks; returns its job id at once."""
        self._check(JobKind.STORE, spans)
        return self._submit(JobKind.STORE, spans, self._engine_event())

    def submit_load(self, spans: Sequence[ChunkSpan]) -> int:
        """Queue a load into the spans' engine blocks; returns its job id at once.

        On CUDA the load's copies also wait for what the engine queued before
        it, so they never race a kernel still reading or writing the blocks
        the load fills (a freed request's last forward pass, say).
        """
        self._check(JobKind.LOAD, spans)
        return self._submit(JobKind.LOAD, spans, self._engine_event())

    def submit_promote(self, spans: Sequence[ChunkSpan]) -> int:
        """Queue a promotion: read the spans' chunks from a lower tier into their CPU slots.

        Each chunk is checksum-verified on the way, as for a load, and copied
        no further: the request that needs them is looked up again once they
        are in and loads them in its step. The spans carry no engine blocks.
        """
        self._check(JobKind.PROMOTE, spans)
        return self._submit(JobKind.PROMOTE, spans, None)

    def load_by_layer(
        self,
        jobs: Sequence[Sequence[ChunkSpan]],
        mode: CopyMode = CopyMode.BEFORE,
        running_states: Sequence[Mapping[int, int]] = (),
    ) -> LayeredLoad:
        """Start the loads the engine's next forward pass reads, layer by layer (:mod:`._layered`).

        Not run on the engine's threads, where they could wait behind store
        jobs writing to disk. They still take the job locks of their chunks, so
        they never race a store or a promotion of them. Their results come from
        :meth:`LayeredLoad.join`, not :meth:`get_finished`. ``running_states``:
        per job, recurrent group -> a second block its state goes into
        (``TransferOrder.running_states``).
        """
        for spans in jobs:
            self._check(JobKind.LOAD, spans)
        orders = [tuple(spans) for spans in jobs]
        return self._layered.start(orders, self._engine_event(), mode, running_states)

    def get_finished(self) -> list[JobResult]:
        """Jobs finished since the last call, each reported exactly once."""
        return self._book.take_finished()

    def wait_for_sources(self, timeout: float | None = None) -> bool:
        """Block until every store submitted so far has finished reading engine blocks.

        A store job first copies its engine blocks into CPU slots, then writes
        the chunks to lower tiers. Once the copies are done the engine may
        reuse those blocks, so a connector calls this before the next forward
        pass instead of waiting for whole jobs (disk and network included).
        ``False`` on timeout.
        """
        return self._book.wait_for_sources(timeout)

    def wait_for_any(self, timeout: float | None = None) -> bool:
        """Block until a finished job waits in ``get_finished`` or none is pending.

        ``False`` on timeout. For a caller with nothing else to do until some
        job ends: sleeping here leaves the GIL to the job threads.
        """
        return self._book.wait_for_any(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job is pending; ``False`` on timeout. Results wait in ``get_finished``."""
        return self._book.wait(timeout)

    def stats(self) -> dict[str, TierStats]:
        """One record per tier, CPU slab first: ``cpu`` counts engine <-> slab copies."""
        return self.cascade.stats()

    def close(self) -> None:
        """Finish queued jobs, then close the tiers; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._book.wait_queued()  # a job waiting for its chunks starts on a thread yet
        for threads in (self._copies, self._jobs, self._promotions):
            threads.shutdown(wait=True)
        self._layered.close()
        self.cascade.close()

    # -- job plumbing ---------------------------------------------------------------
    def _check(self, kind: JobKind, spans: Sequence[ChunkSpan]) -> None:
        """Refuse a job of ``kind`` whose spans the engine cannot run as given, before it queues."""
        for span in spans:
            if self._closed:
                raise TransferError("the offload engine is closed")
            if kind is not JobKind.PROMOTE:
                need = span.blocks.num_chunks(self.transfer.chunk_blocks(span.group))
            elif span.blocks.block_ids:
                raise TransferError(f"group {span.group}: a promotion moves no engine blocks")
            else:
                need = len(span.keys)
            if not len(span.keys) == len(span.slots) == need:
                raise TransferError(
                    f"group {span.group}: {len(span.blocks.block_ids)} blocks at offset "
                    f"{span.blocks.first_offset} touch {need} chunks, but the span has "
                    f"{len(span.keys)} keys and {len(span.slots)} slots"
                )
            if kind is not JobKind.STORE:
                continue
            bpc = self.transfer.chunk_blocks(span.group)
            if not span.blocks.covers_whole_chunks(bpc):
                raise TransferError(
                    f"group {span.group}: a store must cover whole chunks of "
                    f"{bpc} blocks from offset 0, got "
                    f"{len(span.blocks.block_ids)} blocks at offset {span.blocks.first_offset}"
                )

    def _engine_event(self) -> torch.cuda.Event | None:
        if not self.transfer.is_cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.transfer.device))
        return event

    def _submit(
        self, kind: JobKind, spans: Sequence[ChunkSpan], after: torch.cuda.Event | None
    ) -> int:
        job = _Job(self._book.new_id(), kind, tuple(spans), after, time.perf_counter())
        self._book.begin(kind)
        self._book.admit(job.spans, partial(self._start, job))
        return job.job_id

    def _start(self, job: _Job, held: Held) -> None:
        """Hand a job whose locks are free to its thread (from whichever thread freed them)."""
        job.held = held
        if job.kind is JobKind.STORE:
            self._copies.submit(self._copy_out, job)
        elif job.kind is JobKind.LOAD:
            self._jobs.submit(self._run, job)
        else:
            self._promotions.submit(self._run, job)

    def _copy_out(self, job: _Job) -> None:
        """A store's copy out of the engine's blocks, on the copy thread; then its writes."""
        gathered = [False] * len(job.spans)
        try:
            gathered = [self._copier.gather(span, job.after, job.outcome) for span in job.spans]
        except Exception as exc:  # a bug must still report the job, never hang the engine
            self._crashed(job, exc)
        self._book.sources_released()
        if self.cascade.lower:  # lower-tier writes are never made on the copy thread
            self._jobs.submit(self._commit, job, gathered)
        else:
            self._commit(job, gathered)

    def _commit(self, job: _Job, gathered: list[bool]) -> None:
        """Bind a store's copied chunks and write them through to the lower tiers."""
        try:
            if self.faults is not None and self.cascade.lower:
                self.faults.slow_lower()
            for span, ok in zip(job.spans, gathered, strict=True):
                if ok:
                    self._copier.commit(span, job.outcome)
        except Exception as exc:  # a bug must still report the job, never hang the engine
            self._crashed(job, exc)
        self._finish(job)

    def _run(self, job: _Job) -> None:
        """Run a load or a promotion on its thread (a promotion reads while no load runs)."""
        book = self._book
        loading = job.kind is JobKind.LOAD
        if loading:
            book.load_started()
        try:
            for span in job.spans:
                if loading:
                    self._copier.load(span, job.after, job.outcome)
                else:
                    self._copier.promote(span, job.outcome, book.wait_for_loads)
        except Exception as exc:  # a bug must still report the job, never hang the engine
            self._crashed(job, exc)
        finally:
            if loading:
                book.load_ended()
        self._finish(job)

    def _finish(self, job: _Job) -> None:
        """Let the job's chunks go (starting the jobs that waited for them), then report it."""
        try:
            if job.held is not None:
                job.held.close()
        finally:
            seconds = time.perf_counter() - job.submitted
            self._book.end(job.outcome.result(job.job_id, job.kind, seconds))

    @staticmethod
    def _crashed(job: _Job, exc: Exception) -> None:
        """Report an unexpected error: a load loses all its blocks, a store its unbound chunks."""
        outcome, spans = job.outcome, job.spans
        outcome.errors.append(f"{type(exc).__name__}: {exc}")
        if job.kind is not JobKind.STORE:
            outcome.done.clear()
            outcome.failed = [k for s in spans for k in s.keys]
            outcome.failed_blocks = {}
            for span in spans:
                outcome.failed_blocks.setdefault(span.group, []).extend(span.blocks.block_ids)
            return
        done = set(outcome.done) | set(outcome.failed)
        outcome.failed += [k for s in spans for k in s.keys if k not in done]
