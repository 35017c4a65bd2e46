"""kvoffload's connector as the stand-in drives it: the real scheduler and worker sides.

What :mod:`kvoffload.vllm.connector` does with vLLM's objects, this side does
with the stand-in's: the same :class:`~kvoffload.connector.scheduler.OffloadScheduler`
calls on the scheduler side, the same :class:`~kvoffload.connector.worker.OffloadWorker`
calls around the forward pass on the worker side, over a real
:class:`~kvoffload.engine.OffloadEngine` moving real bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from kvoffload.config import OffloadConfig
from kvoffload.connector.key_source import choose_engine_hashes
from kvoffload.connector.loads import failures_by_block, hit_loading
from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.connector.worker import OffloadWorker
from kvoffload.engine import JobKind, OffloadEngine
from kvoffload.keys import EngineHashes
from kvoffload.messages import JobReport, TransferOrder
from kvoffload.standin._types import SimRequest, StepPlan, Stopwatch, WorkerResult
from kvoffload.tiers.base import TierProbe
from kvoffload.tiers.handoff import HandoffBoard

__all__ = ["KVOffloadSide"]

#: The "algorithm" of the stand-in's block hashes, as vLLM's ``prefix_caching_hash_algo``.
STANDIN_HASHES = "kvoffload-standin-blake2b"
#: Longest wait for the engine's jobs at the end of a settled step, in seconds.
SETTLE_TIMEOUT_S = 60.0


class _Meta(NamedTuple):
    """Scheduler -> worker, once per step (the connector's ``KVOffloadMetadata``)."""

    orders: tuple[TransferOrder, ...]
    idle: bool


class KVOffloadSide:
    """One scheduler side and one worker rank over ``kv_caches``.

    ``settle``: every step waits for its jobs, so each one reports in the step
    that ran it and a run is repeatable (the replay and the tests); without
    it, jobs report whenever they finish, as in a live engine. ``record_events``:
    whether the index keeps its events for ``scheduler.take_events``. Keys
    come from the stand-in's block hashes or the token ids as
    ``config.key_source`` says, as in the connector (the stand-in's hashes
    are the same in every process).

    ``transfers=False`` moves no bytes: every order completes at once, as
    vLLM's own connector runs beside it in ``benchmarks/replay_vs_vllm.py``
    (its worker refuses the CPU platform). The scheduler side then runs under
    the same conditions as vLLM's, with no worker working between its calls;
    what it plans and the hits it finds are those of a settled run. Such a
    side has no worker (``worker`` is ``None``): no engine, no CPU slab.
    ``handoff``: a producer's or a consumer's marks (:mod:`kvoffload.tiers.handoff`).
    ``clock``: the scheduler side's seconds (a replay's simulated time; see
    :class:`~kvoffload.connector.scheduler.OffloadScheduler`).
    """

    def __init__(
        self,
        config: OffloadConfig,
        namespace: bytes,
        kv_caches: Mapping[str, torch.Tensor],
        probes: Sequence[TierProbe] = (),
        *,
        settle: bool = True,
        record_events: bool = True,
        transfers: bool = True,
        handoff: HandoffBoard | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        hashes = EngineHashes(math.gcd(*config.layout.tokens_per_block), STANDIN_HASHES)
        self.scheduler = OffloadScheduler(
            config,
            namespace,
            probes,
            engine_hashes=choose_engine_hashes(config, hashes, reproducible=True),
            hit_loading=hit_loading(config, len(config.layout.groups)),
            handoff=handoff,
            clock=clock,
        )
        # Without them the index keeps no events, as the connector's when vLLM
        # publishes none (its default); nobody drains them here.
        self.scheduler.index.record_events = record_events
        self.worker: OffloadWorker | None = None
        if transfers:
            engine = OffloadEngine.from_config(config, kv_caches, namespace)
            by_block = failures_by_block(config.layout, len(config.layout.groups))
            self.worker = OffloadWorker(engine, report_blocks=by_block)
        self.settle = settle
        self.clock = Stopwatch()

    # -- scheduler side ---------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        with self.clock:  # vLLM's on_new_request: it joins the waiting queue
            self.scheduler.request_queued(req.req_id, req.prompt, req.extras, req.block_hashes)
            if self.scheduler.queued.limit:  # tracked from its arrival: vLLM's adapter reads it
                self._read_hint(req)

    def get_num_new_matched_tokens(self, req: SimRequest, num_computed: int) -> int | None:
        with self.clock:
            hit = self.scheduler.lookup(
                req.req_id, req.prompt, num_computed, req.extras, req.block_hashes
            )
            self._read_hint(req)  # at its first lookup, if not at its arrival
            return hit

    def _read_hint(self, req: SimRequest) -> None:
        """The client's ``kv_transfer_params`` (a retention hint), once per request."""
        if req.kv_transfer_params is not None and not req.hint_read:
            req.hint_read = True
            self.scheduler.read_hint(req.req_id, req.kv_transfer_params)

    def loads_in_step(self, req: SimRequest) -> bool:
        return self.scheduler.loads_in_step(req.req_id)

    def update_state_after_alloc(self, req: SimRequest, num_external: int) -> None:
        with self.clock:
            self.scheduler.plan_load(req.req_id, req.blocks, num_external)

    def build_connector_meta(self, plan: StepPlan) -> object:
        scheduled = [
            StepRequest(
                req.req_id,
                req.tokens,
                req.computed,
                n,
                req.blocks,
                req.num_prompt,
                block_hashes=req.block_hashes,
            )
            for req, n in plan.scheduled
        ]
        with self.clock:
            orders = self.scheduler.plan_step(scheduled)  # the stand-in never preempts
        return _Meta(tuple(orders), idle=plan.num_tokens == 0)

    def update_connector_output(self, result: WorkerResult) -> None:
        reports = result.payload
        assert isinstance(reports, list)
        with self.clock:
            for report in reports:
                self.scheduler.on_report(report)

    def request_finished(self, req: SimRequest) -> None:
        with self.clock:
            self.scheduler.request_finished(req.req_id)

    # -- worker side ------------------------------------------------------------------
    def run_worker(self, meta: object, forward: Callable[[], None]) -> WorkerResult:
        """``bind_connector_metadata`` .. ``get_finished`` around the forward pass."""
        assert isinstance(meta, _Meta)
        orders, worker = meta.orders, self.worker
        if worker is None:
            forward()
            return _completed(orders)
        worker.before_forward()
        worker.submit(orders, JobKind.LOAD)
        forward()
        worker.submit(orders, JobKind.STORE)
        if self.settle:
            worker.engine.wait(timeout=SETTLE_TIMEOUT_S)
        polled = worker.poll(idle=meta.idle)
        reports: list[JobReport] = worker.take_reports()
        if self.settle:  # in job order, not the order two job threads happened to finish in
            reports.sort(key=lambda report: report.job_id)
        return WorkerResult(
            polled.finished_recving, polled.failed_recving, worker.take_failed_blocks(), reports
        )

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.scheduler.close()


def _completed(orders: Sequence[TransferOrder]) -> WorkerResult:
    """The worker's answer to ``orders`` had every one of them succeeded at once."""
    loads = [order for order in orders if order.kind is JobKind.LOAD and not order.in_step]
    reports = [
        JobReport(
            order.job_id,
            1,
            frozenset(),
            {} if order.kind is JobKind.STORE else dict.fromkeys(order.keys, 1),
            {},
        )
        for order in orders
    ]
    return WorkerResult({order.req_id for order in loads}, set(), set(), reports)
