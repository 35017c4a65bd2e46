"""The connector's worker side: vLLM's KV tensors and the step's orders in, job reports out.

vLLM builds :class:`~kvoffload.vllm.connector.KVOffloadConnector` once with
``KVConnectorRole.WORKER`` in each worker (one per tensor-parallel rank); that
connector builds a :class:`WorkerSide` and forwards the worker's calls to it.
It holds only this role's state: the rank and its
:class:`~kvoffload.connector.worker.OffloadWorker` (the jobs, tested without
vLLM), which exists once vLLM registers its KV tensors. The orders come in the
metadata vLLM binds to the connector each step
(:class:`~kvoffload.vllm._messages.KVOffloadMetadata`), which the connector
hands on; the reports go back in
:class:`~kvoffload.vllm._messages.KVOffloadWorkerMetadata`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvoffload.connector.loads import failures_by_block
from kvoffload.connector.worker import OffloadWorker
from kvoffload.engine import JobKind
from kvoffload.errors import ProtocolError
from kvoffload.messages import TransferOrder
from kvoffload.vllm._messages import KVOffloadMetadata, KVOffloadWorkerMetadata, forward_pass
from kvoffload.vllm._metrics import Deltas, Payload, worker_payload
from kvoffload.vllm._ranks import tp_rank, worker_engine
from kvoffload.vllm._startup import EngineSetup

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

__all__ = ["WorkerSide"]


class WorkerSide:
    """The worker-side connector's state and calls, one per rank (see the module docstring)."""

    #: The role's name in the connector's error for a call made on the other role.
    ROLE: ClassVar[str] = "worker"

    def __init__(self, setup: EngineSetup) -> None:
        self.setup = setup
        #: This worker's tensor-parallel rank, known once vLLM registers the KV tensors.
        self.rank = 0
        #: The engine-neutral core that runs the jobs: None until register_kv_caches.
        self.worker: OffloadWorker | None = None
        self._deltas = Deltas()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        setup = self.setup
        rank = self.rank = tp_rank(setup.world_size)
        # Only the served groups' layers: vLLM also registers skipped groups' layers and
        # layers that share another layer's KV (Gemma's num_kv_shared_layers).
        served = {name: kv_caches[name] for name in setup.layout.layer_names if name in kv_caches}
        engine = worker_engine(setup.config, served, setup.namespace(rank), rank)
        by_block = failures_by_block(setup.layout, setup.groups.num_vllm_groups)
        self.worker = OffloadWorker(engine, report_blocks=by_block)

    # vLLM 0.33's sleep mode; vLLM 0.32 never calls these.
    def unregister_kv_caches(self) -> None:
        if self.worker is not None:
            self.worker.suspend()

    def restore_kv_caches(self) -> None:
        if self.worker is not None:
            self.worker.resume()

    def before_forward(self) -> None:
        """vLLM bound the step's metadata: the step's forward pass comes next."""
        if self.worker is not None:
            self.worker.before_forward()

    def start_load_kv(self, forward_context: ForwardContext, meta: object) -> None:
        forward = forward_pass(forward_context)
        self._registered("start_load_kv").submit(_orders(meta), JobKind.LOAD, forward=forward)

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self._registered("wait_for_layer_load")
        worker.wait_layer(layer_name)  # in-step loads copy layer by layer

    def wait_for_save(self, meta: object) -> None:
        self._registered("wait_for_save").submit(_orders(meta), JobKind.STORE)

    def get_transfer_results(self, meta: object) -> KVConnectorTransferResults:
        worker = self._registered("get_transfer_results")
        polled = worker.poll(idle=isinstance(meta, KVOffloadMetadata) and meta.idle)
        return KVConnectorTransferResults(
            finished_recving=polled.finished_recving,
            failed_recving=polled.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._registered("get_block_ids_with_load_errors").take_failed_blocks()

    def build_connector_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        if self.worker is None:
            return None
        reports = self.worker.take_reports()
        return KVOffloadWorkerMetadata({r.job_id: r for r in reports}) if reports else None

    def stats(self) -> dict[str, Any]:
        """The jobs' counts and bytes, per tier (none before the KV tensors are registered)."""
        return self.worker.stats() if self.worker is not None else {}

    def step_stats(self) -> Payload | None:
        """What changed in this rank's figures since the last step (see ``_metrics``)."""
        if self.worker is None:
            return None
        return worker_payload(self.worker, self.rank, self._deltas)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def _registered(self, method: str) -> OffloadWorker:
        """The core worker; a job before vLLM registered the KV tensors has nothing to copy."""
        if self.worker is None:
            raise ProtocolError(
                f"KVOffloadConnector.{method} (worker side) was called before register_kv_caches"
            )
        return self.worker


def _orders(meta: object) -> tuple[TransferOrder, ...]:
    """The orders of the step's metadata (none in metadata that is not kvoffload's)."""
    return meta.orders if isinstance(meta, KVOffloadMetadata) else ()
