"""``KVOffloadConnector``: vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA`` over kvoffload.

Written against vLLM 0.32's connector API and checked against 0.33's and
0.34's, which only added methods: 0.33 the sleep mode's, 0.34
``may_load_async``, ``supports_lookahead_block_hashes`` (both below) and
``kv_cache_access``, whose default (``IN_PROCESS``: torch copies in the
worker's process) is what the workers do.

vLLM builds this one class once per role: ``KVConnectorRole.SCHEDULER`` in the
engine core, ``WORKER`` in each worker. The roles share no state while the
engine runs (they meet only in vLLM's metadata envelopes), so each is an
object of its own, holding only its role's state:
:class:`~kvoffload.vllm._scheduler_side.SchedulerSide` and
:class:`~kvoffload.vllm._worker_side.WorkerSide`. This class is the face vLLM
loads: it builds what both roles read alike from vLLM's configuration
(:class:`~kvoffload.vllm._startup.EngineSetup`), then the side of its role,
and forwards each of vLLM's methods to it; a method of the other role raises
``ProtocolError`` naming both roles.

The sides are only glue: they read vLLM's objects (requests, block tables,
scheduler outputs, KV tensors) and hand plain values to
:class:`~kvoffload.connector.scheduler.OffloadScheduler` (scheduler side) and
:class:`~kvoffload.connector.worker.OffloadWorker` (worker side), which hold all
the logic and are tested without vLLM.

Configuration is vLLM's ``kv_connector_extra_config``, validated by
:func:`kvoffload.build_offloading_config` against the layout read from vLLM's
``KVCacheConfig``: every bad value fails at engine start with the same clear
``ConfigError`` as ``kvoffload plan``, on both sides.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
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

from kvoffload.errors import ConfigError, ProtocolError
from kvoffload.vllm._messages import KVOffloadMetadata
from kvoffload.vllm._metrics import empty_payload
from kvoffload.vllm._prom import KVOffloadPromMetrics, KVOffloadStats
from kvoffload.vllm._scheduler_side import SchedulerSide
from kvoffload.vllm._startup import EngineSetup
from kvoffload.vllm._worker_side import WorkerSide

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

_LIVE: weakref.WeakSet[KVOffloadConnector] = weakref.WeakSet()
#: The side a method belongs to, for :meth:`KVOffloadConnector._side_of`.
_Side = TypeVar("_Side", SchedulerSide, WorkerSide)


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
        #: What both roles read alike: the group map and layout, the config, the namespaces.
        self.setup = EngineSetup.read(vllm_config, kv_cache_config)
        #: This role's side; every vLLM method below is forwarded to it.
        self.side: SchedulerSide | WorkerSide
        if role is KVConnectorRole.SCHEDULER:
            self.side = SchedulerSide(self.setup, vllm_config, kv_cache_config)
        else:
            self.side = WorkerSide(self.setup)
        _LIVE.add(self)

    def stats(self) -> dict[str, Any]:
        """This side's counters: offered and loaded tokens (scheduler), jobs and bytes (worker)."""
        return self.side.stats()

    # ==============================================================================
    # Scheduler side
    # ==============================================================================
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        side = self._side_of(SchedulerSide, "get_num_new_matched_tokens")
        return side.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self._side_of(SchedulerSide, "on_new_request").on_new_request(request)

    def may_load_async(self, request: Request) -> bool:
        """Whether the hit needs a lower tier's chunks (vLLM 0.34): see
        :meth:`~kvoffload.vllm._scheduler_side.SchedulerSide.may_load_async`."""
        return self._side_of(SchedulerSide, "may_load_async").may_load_async(request)

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """True: vLLM 0.34 may hash the tokens after each block for an EAGLE-like drafter, as
        kvoffload's keys name them (:func:`~kvoffload.vllm._startup.drafter_lookahead`), so
        its own prefix cache stops dropping a block from every hit; keys come from tokens."""
        return True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        side = self._side_of(SchedulerSide, "update_state_after_alloc")
        side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self._side_of(SchedulerSide, "build_connector_meta")
        return side.build_connector_meta(scheduler_output, self._kv_cache_manager)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        side = self._side_of(SchedulerSide, "update_connector_output")
        side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self._side_of(SchedulerSide, "request_finished_all_groups")
        side.request_finished(request)
        return False, None  # the worker finished reading its blocks before vLLM frees them

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._side_of(SchedulerSide, "take_events").take_events()

    def reset_cache(self) -> bool | None:
        return self._side_of(SchedulerSide, "reset_cache").reset_cache()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    # ==============================================================================
    # Worker side
    # ==============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._side_of(WorkerSide, "register_kv_caches").register_kv_caches(kv_caches)

    # vLLM 0.33's sleep mode; vLLM 0.32 never calls these.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True  # the tiers outlive the device KV cache; jobs drain before it goes

    def unregister_kv_caches(self) -> None:
        self._side_of(WorkerSide, "unregister_kv_caches").unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._side_of(WorkerSide, "restore_kv_caches").restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        side = self._side_of(WorkerSide, "bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)
        side.before_forward()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        side = self._side_of(WorkerSide, "start_load_kv")
        side.start_load_kv(forward_context, self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._side_of(WorkerSide, "wait_for_layer_load").wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None  # stores are submitted once per step, in wait_for_save

    def wait_for_save(self) -> None:
        side = self._side_of(WorkerSide, "wait_for_save")
        side.wait_for_save(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        side = self._side_of(WorkerSide, "get_transfer_results")
        return side.get_transfer_results(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        side = self._side_of(WorkerSide, "get_block_ids_with_load_errors")
        return side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        side = self._side_of(WorkerSide, "build_connector_worker_meta")
        return side.build_connector_worker_meta()

    # ==============================================================================
    # Both sides
    # ==============================================================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's stats of the step (see :mod:`kvoffload.vllm._metrics`), or None."""
        payload = self.side.step_stats()
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
        self.side.close()

    def _side_of(self, side: type[_Side], method: str) -> _Side:
        """This connector's side if it is of ``side``'s role; vLLM called the wrong role if not."""
        if isinstance(self.side, side):
            return self.side
        raise ProtocolError(
            f"KVOffloadConnector.{method} is a {side.ROLE}-side method, called on the "
            f"{self.side.ROLE}-side connector (KVConnectorRole.{self.role.name})"
        )


def _register_by_name() -> None:
    """Enter this class in vLLM's connector registry under its name, as vLLM's own are.

    vLLM loads it by ``kv_connector_module_path``, which needs no entry; but inside
    ``MultiConnector`` the frontend rebuilds each child's stats from the child's class
    name (``KVConnectorFactory.get_connector_class_by_name``), and an unregistered name
    stopped the engine at its first logged step. The frontend imports this module when it
    builds ``MultiConnector``'s Prometheus metrics, before any stats arrive.
    """
    name = KVOffloadConnector.__name__
    with contextlib.suppress(ValueError):  # registered already (this module imported again)
        KVConnectorFactory.register_connector(name, __name__, name)


_register_by_name()
