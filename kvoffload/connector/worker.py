"""The connector's worker side in plain terms: run orders, report them, hold nothing back.

It drives one :class:`~kvoffload.engine.OffloadEngine` over the worker's KV
tensors. vLLM's hooks map onto it as follows (see
:mod:`kvoffload.vllm.connector`):

* loads are submitted as the scheduler ordered them and reported when done;
* stores are submitted after the forward pass (:meth:`OffloadWorker.submit`),
  when the step's KV is written;
* at the end of the step, :meth:`OffloadWorker.poll` first waits until this
  step's stores have finished *reading* engine blocks (a copy into CPU
  slots; disk and network writes go on in the background), then turns
  finished jobs into vLLM's sets: requests whose loads are done
  (``finished_recving``) or failed (``failed_recving``), failed engine block
  ids, and one :class:`JobReport` per job for the scheduler side.

Why wait for the copies at the end of the step? vLLM reuses a block as soon
as the step's output says it may: a request finished, a sliding window moved
past the block, a request was preempted. With every store's copy done by
then, no block is ever handed on under a store still reading it, and
finished requests need not hold their blocks (which would also keep
``reset_prefix_cache`` from working until some later step released them).
:meth:`OffloadWorker.before_forward` repeats the wait before each forward
pass for stores submitted in between.

vLLM's sleep mode (0.33: ``unregister_kv_caches`` / ``restore_kv_caches``)
releases the device KV cache and maps it back at the same addresses:
:meth:`OffloadWorker.suspend` first lets every job finish, and an order that
arrives while suspended fails at once (nothing may touch the released
memory); the tiers, in host memory and below, keep their chunks throughout.

A failed load is never hidden: its blocks are reported, so vLLM recomputes
them (invariant 3). vLLM accepts block ids only for single-group layouts
(block ids repeat across groups of a hybrid one), so hybrid layouts report
the request instead, and vLLM recomputes it from its own prefix-cache hit.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvoffload.connector._in_step import ForwardPass, StepLoads
from kvoffload.connector.stats import WorkerStats
from kvoffload.engine import CopyMode, JobKind, OffloadEngine
from kvoffload.messages import JobReport, JobResult, TransferOrder, merge_reports

__all__ = ["IDLE_WAIT_S", "ForwardPass", "OffloadWorker", "PollResult"]

logger = logging.getLogger("kvoffload")

#: Longest wait of an idle step for a job to finish: short, so a request that arrives
#: meanwhile is scheduled soon, yet long enough to hand the job threads the GIL.
IDLE_WAIT_S = 0.02


@dataclass(slots=True)
class PollResult:
    """What one step reports to vLLM: requests whose loads finished, and those that failed."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class OffloadWorker:
    """Runs transfer orders on ``engine``; see the module docstring.

    ``report_blocks`` is true when vLLM takes failed loads as block ids (a
    single KV cache group); otherwise failed loads are reported per request.
    """

    def __init__(
        self, engine: OffloadEngine, *, report_blocks: bool, copies: CopyMode | None = None
    ) -> None:
        self.engine = engine
        self.report_blocks = report_blocks
        #: How loads in the step copy (:mod:`kvoffload.engine._layered`); measured per device.
        self.copies = CopyMode.default(engine.transfer.is_cuda) if copies is None else copies
        self._orders: dict[int, TransferOrder] = {}  # engine job id -> order
        self._instant: list[TransferOrder] = []  # orders with nothing to run: failed at once
        self._loads = Counter[str]()
        self._failed_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._reports: dict[int, JobReport] = {}
        self._stats = WorkerStats()
        #: Seconds of each finished load and store job, until taken (bounded: no one may take them).
        self._seconds = {
            kind: deque[float](maxlen=10_000) for kind in (JobKind.STORE, JobKind.LOAD)
        }
        self._suspended = False
        self._in_step = StepLoads(engine)

    def suspend(self) -> None:
        """The engine's KV memory is about to be released: wait for every job first."""
        self._in_step.end()
        self.engine.wait()
        self._suspended = True

    def resume(self) -> None:
        """The engine's KV memory is mapped back: orders run again."""
        self._suspended = False

    def before_forward(self) -> None:
        """Wait until earlier stores no longer read engine blocks (see the module docstring)."""
        self._in_step.new_step()
        self.engine.wait_for_sources()

    def submit(
        self,
        orders: Iterable[TransferOrder],
        kind: JobKind,
        *,
        forward: ForwardPass = ForwardPass.LAYER_BY_LAYER,
    ) -> None:
        """Start this step's orders of ``kind``; each is reported once by :meth:`poll`.

        The ``in_step`` loads start here, before the forward pass, and copy as
        ``forward`` lets them (:mod:`kvoffload.connector._in_step`). If one
        fails, every store of the step is failed instead of run.
        """
        if kind is JobKind.STORE:
            self._in_step.end()
        in_step: list[TransferOrder] = []
        # Promotions start with the loads, before the forward pass (they fill CPU slots only).
        kinds = (kind,) if kind is JobKind.STORE else (JobKind.LOAD, JobKind.PROMOTE)
        for order in orders:
            if order.kind not in kinds:
                continue
            if order.kind is JobKind.LOAD and not order.in_step:
                self._loads[order.req_id] += 1
            if self._suspended:  # fails at once: the engine's memory is released
                self._stats.suspended_orders += 1
            voided = kind is JobKind.STORE and self._in_step.failed
            if voided:
                self._stats.voided_store_orders += 1
            if not order.spans or self._suspended or voided:
                self._instant.append(order)
                self._in_step.never_ran(order)
            elif order.in_step:
                in_step.append(order)
            else:
                self._start(order, order.kind)
        if in_step:
            self._start_in_step(in_step, forward)

    def wait_layer(self, name: str) -> None:
        """Return once layer ``name``'s in-step loads are in place (``wait_for_layer_load``)."""
        if self._in_step.copying:
            self._stats.in_step_layer_waits += 1
            self._in_step.wait_layer(name)

    def _start(self, order: TransferOrder, kind: JobKind) -> None:
        try:
            if kind is JobKind.LOAD:
                job_id = self.engine.submit_load(order.spans)
            elif kind is JobKind.PROMOTE:
                job_id = self.engine.submit_promote(order.spans)
            else:
                job_id = self.engine.submit_store(order.spans)
        except Exception as exc:  # a bad order fails its job, never the step
            self._refused(order, exc)
        else:
            self._orders[job_id] = order

    def _start_in_step(self, orders: list[TransferOrder], forward: ForwardPass) -> None:
        try:
            self._in_step.start(orders, forward.copies(self.copies))
        except Exception as exc:  # a bad order fails its job, never the step
            for order in orders:
                self._refused(order, exc)

    def _refused(self, order: TransferOrder, exc: Exception) -> None:
        logger.error("kvoffload: %s order %d refused: %s", order.kind.value, order.job_id, exc)
        self._stats.refused_orders += 1
        self._instant.append(order)
        self._in_step.never_ran(order)

    def poll(self, *, idle: bool = False) -> PollResult:
        """Wait for this step's stores to read their blocks, then collect finished jobs.

        On an ``idle`` step (no forward pass: every request waits for a load,
        or its lookup for a chunk a job is storing or promoting) with jobs in
        flight, first wait up to ``IDLE_WAIT_S`` for one to finish. Returning
        at once would send vLLM round its loop of empty steps, which holds the
        GIL so tightly that the job threads crawl: a 24 MiB load from the CPU
        tier took 150-400 ms that way, against a few ms while this thread
        sleeps.
        """
        self._in_step.end()
        if idle and self._orders:
            self.engine.wait_for_any(IDLE_WAIT_S)
        self.engine.wait_for_sources()
        out = PollResult()
        done: list[tuple[TransferOrder, JobResult | None]] = [*self._in_step.take_results()]
        done += [(self._orders.pop(r.job_id), r) for r in self.engine.get_finished()]
        instant, self._instant = self._instant, []
        for order, result in [*done, *((o, None) for o in instant)]:
            if result is not None and order.kind in self._seconds:
                self._seconds[order.kind].append(result.seconds)
            report = JobReport.of(order, result)
            self._record(order, report)
            if order.kind is JobKind.LOAD:
                self._finish_load(order, report, out)
            elif not report.ok and order.kind is JobKind.STORE:
                self._stats.failed_store_jobs += 1
            elif not report.ok:  # the request is looked up again and finds what did come in
                for line in report.errors:
                    logger.warning("kvoffload: promotion for request %s: %s", order.req_id, line)
        return out

    def _finish_load(self, order: TransferOrder, report: JobReport, out: PollResult) -> None:
        req_id = order.req_id
        if not report.ok:
            self._failed(order, report)
        if order.in_step:  # the request never waited: nothing to tell vLLM but failed blocks
            self._stats.in_step_load_jobs += 1
            return
        self._loads[req_id] -= 1
        if self._loads[req_id] <= 0:
            del self._loads[req_id]
            out.finished_recving.add(req_id)
            if req_id in self._failed_loads:
                self._failed_loads.discard(req_id)
                out.failed_recving.add(req_id)

    def _failed(self, order: TransferOrder, report: JobReport) -> None:
        """Count a failed load and hand its blocks (or its request) to vLLM to recompute."""
        self._stats.failed_load_jobs += 1
        self._stats.failed_load_blocks += sum(len(b) for b in report.failed_blocks.values())
        for line in report.errors:
            logger.warning("kvoffload: load for request %s: %s", order.req_id, line)
        if self.report_blocks:
            for ids in report.failed_blocks.values():
                self._failed_blocks |= ids
        elif not order.in_step:
            self._failed_loads.add(order.req_id)
        else:  # load_in_step "always" on a layout vLLM cannot recompute by block
            self._stats.unrecoverable_load_jobs += 1
            logger.error(
                "kvoffload: a same-step load for request %s failed on a layout where vLLM "
                "cannot recompute it block by block: its output may be wrong (set "
                "load_in_step to auto)",
                order.req_id,
            )

    def _record(self, order: TransferOrder, report: JobReport) -> None:
        old = self._reports.get(order.job_id)
        self._reports[order.job_id] = report if old is None else merge_reports(old, report)
        stats, failed = self._stats, len(report.failed_keys)
        if order.kind is JobKind.LOAD:
            stats.load_jobs += 1
            stats.load_chunks += len(order.keys) - failed
            stats.failed_load_chunks += failed
        elif order.kind is JobKind.PROMOTE:
            stats.promote_jobs += 1
            stats.promoted_chunks += len(order.keys) - failed
            stats.failed_promote_chunks += failed
        else:
            stats.store_jobs += 1
            stats.store_chunks += len(order.keys) - failed
            stats.failed_store_chunks += failed

    def take_failed_blocks(self) -> set[int]:
        """Engine block ids whose load failed since the last call (single-group layouts)."""
        self._in_step.end()
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def take_seconds(self) -> dict[str, list[float]]:
        """Durations of the jobs finished since the last call, by kind (``load``, ``store``)."""
        out = {kind.value: list(samples) for kind, samples in self._seconds.items()}
        for samples in self._seconds.values():
            samples.clear()
        return out

    def take_reports(self) -> list[JobReport]:
        """Job reports since the last call, for the scheduler side."""
        reports, self._reports = list(self._reports.values()), {}
        return reports

    def stats(self) -> dict[str, Any]:
        """This side's job counters since start, and ``tiers``: each tier's stats as numbers.

        Jobs are counted here, from their reports; bytes, hits and failures of
        each tier are counted by the tier (``TierStats.snapshot()``).
        """
        out: dict[str, Any] = self.job_counts()
        out["tiers"] = {name: stats.snapshot() for name, stats in self.engine.stats().items()}
        return out

    def job_counts(self) -> dict[str, int]:
        """:meth:`stats` without the tiers (the metrics read those as records, every step)."""
        out = self._stats.snapshot()
        if self.engine.faults is not None:  # a negative control shows its fault fired
            out.update(self.engine.faults.stats())
        return out

    def close(self) -> None:
        """Let queued jobs finish, then release the engine and its tiers."""
        self.engine.close()
