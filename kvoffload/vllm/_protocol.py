"""The messages between the connector's two sides, in plain terms (no vLLM types).

The scheduler side decides and the worker side moves bytes (DESIGN.md); they
meet in two small records that cross vLLM's process boundary once per step:

* :class:`TransferOrder`, scheduler -> worker: one store or load job with
  the chunk keys, CPU slots and engine blocks the index assigned.
* :class:`JobReport`, worker -> scheduler: how that job ended on the
  workers that reported so far. With tensor parallelism every rank runs the
  same order on its own shard, so reports of one job are merged: a key
  failed if it failed on any rank, and the job is final once ``workers``
  reaches the world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvoffload.engine.results import ChunkSpan, JobKind, JobResult

__all__ = ["JobReport", "TransferOrder", "merge_reports"]


@dataclass(frozen=True, slots=True)
class TransferOrder:
    """One job for every worker: ``spans`` per group, as the engine takes them."""

    job_id: int
    req_id: str
    kind: JobKind
    spans: tuple[ChunkSpan, ...]
    #: Load only: group -> engine blocks promised to vLLM that no tier can fill
    #: (no CPU slot could be reserved for their promotion). The worker reports
    #: them failed at once, so vLLM recomputes them.
    unloadable: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def keys(self) -> tuple[bytes, ...]:
        return tuple(key for span in self.spans for key in span.keys)


@dataclass(frozen=True, slots=True)
class JobReport:
    """The outcome of one order on ``workers`` ranks (merged with :func:`merge_reports`)."""

    job_id: int
    workers: int
    failed_keys: frozenset[bytes]
    #: key -> ranks that promoted it from a lower tier into its CPU slot.
    promoted: Mapping[bytes, int]
    #: Engine blocks not loaded, per group (load only).
    failed_blocks: Mapping[int, frozenset[int]]
    errors: tuple[str, ...] = ()

    @classmethod
    def of(cls, order: TransferOrder, result: JobResult | None) -> JobReport:
        """This rank's report: from the engine's result, or a failure with no job run."""
        failed_blocks = {g: frozenset(ids) for g, ids in order.unloadable.items() if ids}
        if result is None:  # nothing ran: a load lost every block it was to fill
            if order.kind is JobKind.LOAD:
                for span in order.spans:
                    known = failed_blocks.get(span.group, frozenset())
                    failed_blocks[span.group] = known | frozenset(span.blocks.block_ids)
            return cls(order.job_id, 1, frozenset(order.keys), {}, failed_blocks)
        for group, ids in result.failed_blocks.items():
            failed_blocks[group] = failed_blocks.get(group, frozenset()) | frozenset(ids)
        return cls(
            order.job_id,
            1,
            frozenset(result.failed_keys),
            dict.fromkeys(result.promoted_keys, 1),
            failed_blocks,
            result.errors[:4],
        )

    @property
    def ok(self) -> bool:
        return not self.failed_keys and not any(self.failed_blocks.values())


def merge_reports(a: JobReport, b: JobReport) -> JobReport:
    """One report for the ranks of ``a`` and ``b`` together (same job)."""
    promoted = dict(a.promoted)
    for key, count in b.promoted.items():
        promoted[key] = promoted.get(key, 0) + count
    blocks = dict(a.failed_blocks)
    for group, ids in b.failed_blocks.items():
        blocks[group] = blocks.get(group, frozenset()) | ids
    return JobReport(
        a.job_id,
        a.workers + b.workers,
        a.failed_keys | b.failed_keys,
        promoted,
        blocks,
        (a.errors + b.errors)[:4],
    )
