"""The connector's messages in vLLM's envelopes: orders to the workers, reports back.

vLLM carries a ``KVConnectorMetadata`` from the scheduler side to every
worker each step, and a ``KVConnectorWorkerMetadata`` back, merging the
workers' with ``aggregate``; these wrap kvoffload's plain messages
(:mod:`kvoffload.messages`). The step's forward context tells the worker how
the forward pass that reads its loads runs (:func:`forward_pass`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoffload.connector.worker import ForwardPass
from kvoffload.messages import JobReport, TransferOrder, merge_reports

__all__ = ["KVOffloadMetadata", "KVOffloadWorkerMetadata", "forward_pass"]


def forward_pass(forward_context: object) -> ForwardPass:
    """How vLLM runs the step's forward pass, as the worker side names it.

    A full CUDA graph (``CUDAGraphMode.FULL``) replays the whole pass and calls no
    ``wait_for_layer_load``; an eager or piecewise pass calls it before each attention layer.
    """
    graph = getattr(getattr(forward_context, "cudagraph_runtime_mode", None), "name", "")
    return ForwardPass.FULL_GRAPH if graph == "FULL" else ForwardPass.LAYER_BY_LAYER


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the orders to run.

    ``idle``: the step runs no forward pass (every request waits for a load
    or a chunk in flight), so the worker may wait for its jobs instead of
    returning at once (see :meth:`kvoffload.connector.worker.OffloadWorker.poll`).
    """

    orders: tuple[TransferOrder, ...] = ()
    idle: bool = False


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: job reports, merged across ranks by job id."""

    reports: dict[int, JobReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise TypeError(f"cannot merge {type(other).__name__} into KVOffloadWorkerMetadata")
        merged = dict(self.reports)
        for job_id, report in other.reports.items():
            mine = merged.get(job_id)
            merged[job_id] = report if mine is None else merge_reports(mine, report)
        return KVOffloadWorkerMetadata(merged)
