"""The connector's scheduler side: vLLM's scheduler calls in, the connector core's plain terms out.

vLLM builds :class:`~kvoffload.vllm.connector.KVOffloadConnector` once with
``KVConnectorRole.SCHEDULER``, in the engine core; that connector builds a
:class:`SchedulerSide` and forwards the scheduler's calls to it. It holds only
this role's state: the :class:`~kvoffload.connector.scheduler.OffloadScheduler`
(the lookup, the plans and the index, tested without vLLM), the vLLM requests
it looked up, what their KV depends on besides tokens, and the KV events. It
reads vLLM's requests, block lists and scheduler outputs, and sends the
workers their orders in :class:`~kvoffload.vllm._messages.KVOffloadMetadata`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.engine import JobKind
from kvoffload.vllm._events import ChunkEvents
from kvoffload.vllm._extras import ExtrasReader, Unkeyable
from kvoffload.vllm._layout import boundary_states
from kvoffload.vllm._messages import KVOffloadMetadata, KVOffloadWorkerMetadata
from kvoffload.vllm._metrics import Deltas, Payload, scheduler_series
from kvoffload.vllm._startup import EngineSetup, build_scheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]


class SchedulerSide:
    """The scheduler-side connector's state and calls, one per engine (see the module docstring)."""

    #: The role's name in the connector's error for a call made on the other role.
    ROLE: ClassVar[str] = "scheduler"

    def __init__(
        self, setup: EngineSetup, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.setup = setup
        namespaces = [setup.namespace(rank) for rank in range(setup.world_size)]
        #: The engine-neutral core that decides hits, loads and stores.
        self.scheduler: OffloadScheduler = build_scheduler(
            vllm_config, kv_cache_config, setup, namespaces
        )
        #: vLLM's requests this side looked up and has not seen finish, by id.
        self._requests: dict[str, Request] = {}
        self._extras = ExtrasReader()
        self._deltas = Deltas()
        #: Requests whose last lookup found chunks in a lower tier (see may_load_async).
        self._from_lower: set[str] = set()
        inflight = getattr(vllm_config.scheduler_config, "max_num_inflight_kv_loads", None)
        self._lookup_on_arrival = bool(inflight) and bool(self.scheduler.probes)
        self._events: ChunkEvents | None = None
        events = vllm_config.kv_events_config
        if events is not None and events.enable_kv_cache_events:
            self._events = ChunkEvents(setup.groups, setup.config.blocks_per_chunk, kv_cache_config)
        else:  # vLLM drains take_events every step; nothing to build or publish
            self.scheduler.index.record_events = False

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        extras, first = None, req_id not in self._requests
        if first:  # a repeated lookup: its state holds the extras
            try:
                extras = self._extras.read(request)
            except Unkeyable as exc:
                self._extras.refuse(str(exc))
                return 0, False
            self._requests[req_id] = request
        hit = self.scheduler.lookup(
            req_id, request.all_token_ids, num_computed_tokens, extras, request.block_hashes
        )
        if first and request.kv_transfer_params:  # a client's retention hint, if any
            self.scheduler.read_hint(req_id, request.kv_transfer_params)
        if self.scheduler.loads_from_lower_tier(req_id):
            self._from_lower.add(req_id)
        else:
            self._from_lower.discard(req_id)
        return hit, bool(hit) and not self.scheduler.loads_in_step(req_id)

    def on_new_request(self, request: Request) -> None:
        """A request joins vLLM's waiting queue: hold the CPU-tier chunks it will hit until it
        runs (``queued_cpu_share``). With a lower tier and vLLM 0.34's
        ``max_num_inflight_kv_loads``, also look it up now, when vLLM asks
        :meth:`may_load_async`, as the first ``get_num_new_matched_tokens`` would."""
        req_id = request.request_id
        if self.scheduler.queued.limit and req_id not in self._requests:
            try:
                extras = self._extras.read(request)
            except Unkeyable:
                pass  # its lookup refuses it, and counts it once
            else:
                self._requests[req_id] = request
                self.scheduler.request_queued(
                    req_id,
                    request.all_token_ids,
                    extras,
                    request.block_hashes,
                    fetch=not self._lookup_on_arrival,  # vLLM 0.34 then loads while queued
                )
                if request.kv_transfer_params:
                    self.scheduler.read_hint(req_id, request.kv_transfer_params)
        if self._lookup_on_arrival:
            self.get_num_new_matched_tokens(request, 0)

    def may_load_async(self, request: Request) -> bool:
        """Whether the last lookup's hit needs chunks from the disk or remote tier (vLLM 0.34).

        Such a load takes steps, so vLLM may start it while its running batch
        is full. A hit in host memory loads in the step that schedules the
        request (or one step later, see ``load_in_step``), so it waits for a
        running slot like any request. A lower-tier chunk found past the hit
        makes a false positive, which only holds back other loads until a slot
        frees.
        """
        return request.request_id in self._from_lower

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if request.request_id not in self._requests:
            return
        groups = self.setup.groups
        block_ids = groups.served_block_ids(blocks.get_block_ids()) if num_external_tokens else ()
        order = self.scheduler.plan_load(request.request_id, block_ids, num_external_tokens)
        if order is not None and self._events is not None:
            self._events.describe(request, order, block_ids, self.scheduler.index.storing_mask)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, manager: KVCacheManager | None
    ) -> KVOffloadMetadata:
        """The step's orders for the workers, from the requests vLLM scheduled in it."""
        groups = self.setup.groups
        new, cached = scheduler_output.scheduled_new_reqs, scheduler_output.scheduled_cached_reqs
        steps = [(r.req_id, r.num_computed_tokens) for r in new]
        steps += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        handed = boundary_states(scheduler_output)
        scheduled = [
            StepRequest(
                req_id,
                request.all_token_ids,
                computed,
                scheduler_output.num_scheduled_tokens.get(req_id, 0),
                groups.served_block_ids(manager.get_block_ids(req_id)),
                request.num_prompt_tokens,
                groups.served_states(handed.get(req_id, ())),
                request.block_hashes,
            )
            for req_id, computed in steps
            if (request := self._requests.get(req_id)) is not None and manager is not None
        ]
        orders = self.scheduler.plan_step(scheduled, scheduler_output.preempted_req_ids or ())
        if self._events is not None:
            blocks = {step.req_id: step.block_ids for step in scheduled}
            for order in orders:
                if order.kind is JobKind.STORE and order.req_id in blocks:
                    request, ids = self._requests[order.req_id], blocks[order.req_id]
                    self._events.describe(request, order, ids, self.scheduler.index.storing_mask)
        idle = scheduler_output.total_num_scheduled_tokens == 0
        return KVOffloadMetadata(tuple(orders), idle=idle)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' job reports of the step, merged across ranks by vLLM."""
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVOffloadWorkerMetadata):
            for report in meta.reports.values():
                self.scheduler.on_report(report)

    def request_finished(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        self._from_lower.discard(request.request_id)
        self.scheduler.request_finished(request.request_id)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The CPU tier's changes as vLLM's events (see :mod:`kvoffload.vllm._events`)."""
        if self._events is None:
            return []
        return self._events.events(self.scheduler.take_events(), self.scheduler.index.storing_mask)

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset()

    def stats(self) -> dict[str, Any]:
        """The core's counters (offered and loaded tokens, misses by reason) and refusals."""
        out: dict[str, Any] = self.scheduler.stats()
        out["unkeyable_requests"] = self._extras.refused
        return out

    def step_stats(self) -> Payload | None:
        """What changed in :meth:`stats` since the last step (:mod:`kvoffload.vllm._metrics`)."""
        return self._deltas.take(*scheduler_series(self.stats()))

    def close(self) -> None:
        self.scheduler.close()
