"""``KVOffloadConnector``: vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA`` over kvoffload.

Written against vLLM 0.32's connector API and checked against 0.33's and
0.34's, which only added methods: 0.33 the sleep mode's, 0.34
``may_load_async``, ``supports_lookahead_block_hashes`` (both below) and
``kv_cache_access``, whose default (``IN_PROCESS``: torch copies in the
worker's process) is what the workers do.

This module is only glue: it reads vLLM's objects (requests, block tables,
scheduler outputs, KV tensors) and hands plain values to
:class:`~kvoffload.connector.scheduler.OffloadScheduler` (scheduler side) and
:class:`~kvoffload.connector.worker.OffloadWorker` (worker side), which hold all
the logic and are tested without vLLM.

Configuration is vLLM's ``kv_connector_extra_config``, validated by
:func:`kvoffload.build_offloading_config` against the layout read from vLLM's
``KVCacheConfig``: every bad value fails at engine start with the same clear
``ConfigError`` as ``kvoffload plan``, on both sides.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.config import OffloadConfig, build_offloading_config
from kvoffload.config.layout import KVLayout
from kvoffload.connector.loads import failures_by_block
from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.connector.worker import OffloadWorker
from kvoffload.engine import JobKind
from kvoffload.errors import ConfigError, ProtocolError
from kvoffload.keys import namespace_of
from kvoffload.messages import TransferOrder
from kvoffload.vllm._events import ChunkEvents
from kvoffload.vllm._extras import ExtrasReader, Unkeyable
from kvoffload.vllm._layout import GroupMap, boundary_states, group_map
from kvoffload.vllm._messages import KVOffloadMetadata, KVOffloadWorkerMetadata, forward_pass
from kvoffload.vllm._metrics import Deltas, empty_payload, scheduler_series, worker_payload
from kvoffload.vllm._prom import KVOffloadPromMetrics, KVOffloadStats
from kvoffload.vllm._ranks import tp_rank, worker_engine
from kvoffload.vllm._startup import build_scheduler, check_engine, drafter_lookahead, kv_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVOffloadConnector", "KVOffloadMetadata", "KVOffloadStats", "active_connectors"]

logger = logging.getLogger("kvoffload")

_LIVE: weakref.WeakSet[KVOffloadConnector] = weakref.WeakSet()


def active_connectors() -> list[KVOffloadConnector]:
    """The connectors alive in this process (scheduler side first): for tests and tools."""
    return sorted(_LIVE, key=lambda c: c.role.value)


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads KV chunks of every cache group to CPU, disk and lower tiers, and loads them back.

    One on the scheduler side, one per worker (see the module docstring). A
    CPU-tier hit loads in the step that asks for it (``load_in_step``), a
    lower tier's over later steps; stores run after each forward pass.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if kv_cache_config is None:
            raise ConfigError(
                "KVOffloadConnector needs vLLM's KVCacheConfig (vLLM 0.32 or newer passes it)"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        check_engine(vllm_config, kv_cache_config)
        #: vLLM's groups as served (the layout) or skipped; see ``kvoffload.vllm._layout``.
        self.groups: GroupMap = group_map(kv_cache_config, drafter_lookahead(vllm_config))
        self.layout: KVLayout = self.groups.layout
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.world_size = vllm_config.parallel_config.tensor_parallel_size
        self.config: OffloadConfig = build_offloading_config(
            extra, self.layout, world_size=self.world_size, warn=logger.warning
        )
        self._model_id = kv_identity(vllm_config, self.groups)
        self._dtype = str(vllm_config.model_config.dtype)
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        self._requests: dict[str, Request] = {}
        self._extras = ExtrasReader()
        self._deltas = Deltas()
        self._rank = 0
        self._events: ChunkEvents | None = None
        #: Requests whose last lookup found chunks in a lower tier (see may_load_async).
        self._from_lower: set[str] = set()
        self._lookup_on_arrival = False
        if role is KVConnectorRole.SCHEDULER:
            namespaces = [self.namespace(rank) for rank in range(self.world_size)]
            self._scheduler = build_scheduler(vllm_config, kv_cache_config, self.config, namespaces)
            inflight = getattr(vllm_config.scheduler_config, "max_num_inflight_kv_loads", None)
            self._lookup_on_arrival = bool(inflight) and bool(self._scheduler.probes)
            events = vllm_config.kv_events_config
            if events is not None and events.enable_kv_cache_events:
                self._events = ChunkEvents(
                    self.groups, self.config.blocks_per_chunk, kv_cache_config
                )
            else:  # vLLM drains take_events every step; nothing to build or publish
                self._scheduler.index.record_events = False
        _LIVE.add(self)

    def namespace(self, rank: int) -> bytes:
        """Rank ``rank``'s namespace: its own if ranks hold shards, one if all is replicated."""
        shards = self.world_size > 1 and not self.layout.replicated
        model = f"{self._model_id}#tp{rank}" if shards else self._model_id
        return namespace_of(model, self._dtype, self.layout)

    def stats(self) -> dict[str, Any]:
        """This side's counters: offered and loaded tokens (scheduler), jobs and bytes (worker)."""
        if self._scheduler is not None:
            out: dict[str, Any] = self._scheduler.stats()
            out["unkeyable_requests"] = self._extras.refused
            return out
        return self._worker.stats() if self._worker is not None else {}

    # ==============================================================================
    # Scheduler side
    # ==============================================================================
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        scheduler = self._scheduler_side()
        req_id = request.request_id
        extras = None
        if req_id not in self._requests:  # a repeated lookup: its state holds the extras
            try:
                extras = self._extras.read(request)
            except Unkeyable as exc:
                self._extras.refuse(str(exc))
                return 0, False
            self._requests[req_id] = request
        hit = scheduler.lookup(req_id, request.all_token_ids, num_computed_tokens, extras,
                               request.block_hashes)  # fmt: skip
        if scheduler.loads_from_lower_tier(req_id):
            self._from_lower.add(req_id)
        else:
            self._from_lower.discard(req_id)
        return hit, bool(hit) and not scheduler.loads_in_step(req_id)

    def on_new_request(self, request: Request) -> None:
        """With a lower tier and vLLM 0.34's ``max_num_inflight_kv_loads``: look up on arrival,
        when vLLM asks :meth:`may_load_async`, as the first ``get_num_new_matched_tokens`` would."""
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

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """True: vLLM 0.34 may hash the tokens after each block for an EAGLE-like drafter, as
        kvoffload's keys name them (:func:`~kvoffload.vllm._startup.drafter_lookahead`), so
        its own prefix cache stops dropping a block from every hit; keys come from tokens."""
        return True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if request.request_id not in self._requests:
            return
        block_ids = (
            self.groups.served_block_ids(blocks.get_block_ids()) if num_external_tokens else ()
        )
        scheduler = self._scheduler_side()
        order = scheduler.plan_load(request.request_id, block_ids, num_external_tokens)
        if order is not None and self._events is not None:
            self._events.describe(request, order, block_ids, scheduler.index.storing_mask)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
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
                self.groups.served_block_ids(manager.get_block_ids(req_id)),
                request.num_prompt_tokens,
                self.groups.served_states(handed.get(req_id, ())),
                request.block_hashes,
            )
            for req_id, computed in steps
            if (request := self._requests.get(req_id)) is not None and manager is not None
        ]
        scheduler = self._scheduler_side()
        orders = scheduler.plan_step(scheduled, scheduler_output.preempted_req_ids or ())
        if self._events is not None:
            blocks = {step.req_id: step.block_ids for step in scheduled}
            for order in orders:
                if order.kind is JobKind.STORE and order.req_id in blocks:
                    request, ids = self._requests[order.req_id], blocks[order.req_id]
                    self._events.describe(request, order, ids, scheduler.index.storing_mask)
        idle = scheduler_output.total_num_scheduled_tokens == 0
        return KVOffloadMetadata(tuple(orders), idle=idle)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVOffloadWorkerMetadata):
            scheduler = self._scheduler_side()
            for report in meta.reports.values():
                scheduler.on_report(report)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._from_lower.discard(request.request_id)
        self._scheduler_side().request_finished(request.request_id)
        return False, None  # the worker finished reading its blocks before vLLM frees them

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The CPU tier's changes as vLLM's events (see :mod:`kvoffload.vllm._events`)."""
        scheduler = self._scheduler_side()
        if self._events is None:
            return []
        return self._events.events(scheduler.take_events(), scheduler.index.storing_mask)

    def reset_cache(self) -> bool | None:
        return self._scheduler_side().reset()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    def _scheduler_side(self) -> OffloadScheduler:
        if self._scheduler is None:
            raise ProtocolError("a scheduler-side method was called on the worker-side connector")
        return self._scheduler

    # ==============================================================================
    # Worker side
    # ==============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        rank = self._rank = tp_rank(self.world_size)
        # Only the served groups' layers: vLLM also registers skipped groups' layers and
        # layers that share another layer's KV (Gemma's num_kv_shared_layers).
        served = {name: kv_caches[name] for name in self.layout.layer_names if name in kv_caches}
        engine = worker_engine(self.config, served, self.namespace(rank), rank)
        by_block = failures_by_block(self.layout, self.groups.num_vllm_groups)
        self._worker = OffloadWorker(engine, report_blocks=by_block)

    # vLLM 0.33's sleep mode; vLLM 0.32 never calls these.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True  # the tiers outlive the device KV cache; jobs drain before it goes

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.suspend()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.resume()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.before_forward()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        forward = forward_pass(forward_context)
        self._worker_side().submit(self._orders(), JobKind.LOAD, forward=forward)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_layer(layer_name)  # in-step loads copy layer by layer

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None  # stores are submitted once per step, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker_side().submit(self._orders(), JobKind.STORE)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self._worker_side()
        meta = self._get_connector_metadata()
        polled = worker.poll(idle=isinstance(meta, KVOffloadMetadata) and meta.idle)
        return KVConnectorTransferResults(
            finished_recving=polled.finished_recving,
            failed_recving=polled.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        reports = self._worker.take_reports()
        return KVOffloadWorkerMetadata({r.job_id: r for r in reports}) if reports else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's stats of the step (see :mod:`kvoffload.vllm._metrics`), or None."""
        if self._scheduler is not None:
            payload = self._deltas.take(*scheduler_series(self.stats()))
        elif self._worker is not None:
            payload = worker_payload(self._worker, self._rank, self._deltas)
        else:
            return None
        return None if payload is None else KVOffloadStats(data=payload)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVOffloadStats(data=dict(data or empty_payload()))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """``vllm:kvoffload_*`` series in vLLM's ``/metrics`` (see :mod:`kvoffload.vllm._prom`)."""
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _orders(self) -> tuple[TransferOrder, ...]:
        meta = self._get_connector_metadata()
        return meta.orders if isinstance(meta, KVOffloadMetadata) else ()

    def _worker_side(self) -> OffloadWorker:
        if self._worker is None:
            raise ProtocolError(
                "a worker-side method was called before register_kv_caches "
                "(or on the scheduler-side connector)"
            )
        return self._worker
