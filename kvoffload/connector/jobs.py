"""The job book: orders out to the workers, their reports back, a job done once every rank reported.

The scheduler side numbers every load and store order, hands the step's orders to the
engine's connector metadata (:meth:`JobBook.take_orders`) and folds the workers' reports
(:meth:`JobBook.fold`). With tensor parallelism every rank runs every order on its shard,
so a job completes, and its pins and reservations in the index are released, only when
``world_size`` reports are in: a chunk is stored when every rank stored its part.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvoffload.connector._request import JobState, RequestState
from kvoffload.messages import ChunkSpan, JobKind, JobReport, TransferOrder, merge_reports

__all__ = ["JobBook"]


class JobBook:
    """Job ids, the orders queued for the next step, and the jobs in flight."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self._jobs: dict[int, JobState] = {}
        self._orders: list[TransferOrder] = []
        self._next_job = 1

    def __len__(self) -> int:
        """Jobs in flight: queued or running, not yet reported by every rank."""
        return len(self._jobs)

    def order(
        self,
        req_id: str,
        kind: JobKind,
        spans: tuple[ChunkSpan, ...],
        unloadable: Mapping[int, tuple[int, ...]] | None = None,
        *,
        in_step: bool = False,
    ) -> TransferOrder:
        """A new order under the next job id (queue it with :meth:`queue`)."""
        job_id, self._next_job = self._next_job, self._next_job + 1
        return TransferOrder(job_id, req_id, kind, spans, unloadable or {}, in_step=in_step)

    def queue(self, req: RequestState, job: JobState) -> None:
        """Send ``job`` 's order with the next step; ``req`` waits for it before it is forgotten."""
        self._jobs[job.order.job_id] = job
        req.jobs.add(job.order.job_id)
        self._orders.append(job.order)

    def revise(self, job: JobState, order: TransferOrder) -> None:
        """Send ``order`` instead of ``job`` 's queued one (the same job id, not sent yet)."""
        queued = next(i for i, queued in enumerate(self._orders) if queued is job.order)
        self._orders[queued] = job.order = order

    def take_orders(self) -> list[TransferOrder]:
        """Orders queued since the last call, for this step's connector metadata."""
        orders, self._orders = self._orders, []
        return orders

    def fold(self, report: JobReport) -> JobState | None:
        """Fold one worker's report in; the job, with every rank's report merged, once complete.

        ``None`` while ranks are still to report, and for a job this book does not hold
        (reported already, or from before a restart).
        """
        job = self._jobs.get(report.job_id)
        if job is None:
            return None
        job.report = report if job.report is None else merge_reports(job.report, report)
        if job.report.workers < self.world_size:
            return None
        del self._jobs[report.job_id]
        return job
