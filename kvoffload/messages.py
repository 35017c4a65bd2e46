"""The plain messages between the scheduler side and the worker side.

The scheduler side decides and the worker side moves bytes (DESIGN.md); they
meet only in these records, which cross vLLM's process boundary once per step
and never carry a tensor. This module imports neither torch nor vLLM, so the
scheduler side (the connector's :mod:`kvoffload.connector.scheduler`, the index,
the replay) runs in a process where torch cannot be imported.

* :class:`BlockSpan`: engine block ids of one group and where the first sits
  inside its chunk.
* :class:`ChunkSpan`: one group's part of a job (chunk keys, CPU slots, blocks).
* :class:`TransferOrder`, scheduler -> worker: one store or load job.
* :class:`JobResult`: how the offload engine ran one job on one worker.
* :class:`JobReport`, worker -> scheduler: how an order ended on the workers
  that reported so far. With tensor parallelism every rank runs the same
  order on its own shard, so reports of one job are merged
  (:func:`merge_reports`): a key failed if it failed on any rank, and the job
  is final once ``workers`` reaches the world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from kvoffload._checks import checked_int
from kvoffload.errors import TransferError

__all__ = [
    "BlockSpan",
    "ChunkSpan",
    "JobKind",
    "JobReport",
    "JobResult",
    "JobStatus",
    "NO_BLOCKS",
    "TransferOrder",
    "merge_reports",
]


#: The types of a block id list that needs no closer look.
_INTS = {int}


@dataclass(frozen=True, slots=True)
class BlockSpan:
    """Engine block ids of one group, moved to or from consecutive chunks.

    ``first_offset`` is the index of ``block_ids[0]`` inside its chunk: 0 for
    stores (which cover whole chunks), possibly more for a load that starts
    inside a chunk because the engine already holds the chunk's first blocks.
    A promotion's spans have none (:data:`NO_BLOCKS`): it fills CPU slots only.
    """

    block_ids: tuple[int, ...]
    first_offset: int = 0

    def __post_init__(self) -> None:
        ids = self.block_ids
        # Every order carries one per block: check plain ints at C speed, the rest one by one.
        if type(ids) is not tuple or (ids and ({*map(type, ids)} != _INTS or min(ids) < 0)):
            ids = tuple(checked_int("block id", b, minimum=0, error=TransferError) for b in ids)
        object.__setattr__(self, "block_ids", ids)
        if type(self.first_offset) is not int or self.first_offset < 0:  # checked in full
            checked_int("first_offset", self.first_offset, minimum=0, error=TransferError)

    def num_chunks(self, blocks_per_chunk: int) -> int:
        """Chunks the span touches."""
        return -(-(self.first_offset + len(self.block_ids)) // blocks_per_chunk)

    def chunk_ranges(self, blocks_per_chunk: int) -> list[tuple[int, int, int]]:
        """Per chunk ``(start, stop, position)``: ``block_ids[start:stop]`` go to ``position..``."""
        if self.first_offset >= blocks_per_chunk:
            raise TransferError(
                f"first_offset {self.first_offset} must be < blocks_per_chunk {blocks_per_chunk}"
            )
        ranges = []
        start, position, n = 0, self.first_offset, len(self.block_ids)
        while start < n:
            stop = min(n, start + blocks_per_chunk - position)
            ranges.append((start, stop, position))
            start, position = stop, 0
        return ranges

    @staticmethod
    def is_whole(chunk_range: tuple[int, int, int], blocks_per_chunk: int) -> bool:
        """Whether one of :meth:`chunk_ranges`' entries fills its chunk from position 0."""
        start, stop, position = chunk_range
        return position == 0 and stop - start == blocks_per_chunk

    def covers_whole_chunks(self, blocks_per_chunk: int) -> bool:
        """Whether the span starts and ends on chunk boundaries (required to store)."""
        return self.first_offset == 0 and len(self.block_ids) % blocks_per_chunk == 0

    def sub(self, first_chunk: int, stop_chunk: int, blocks_per_chunk: int) -> BlockSpan:
        """The part of the span inside chunks ``[first_chunk, stop_chunk)``."""
        ranges = self.chunk_ranges(blocks_per_chunk)[first_chunk:stop_chunk]
        if not ranges:
            raise TransferError(f"chunks [{first_chunk}, {stop_chunk}) are outside the span")
        return BlockSpan(self.block_ids[ranges[0][0] : ranges[-1][1]], ranges[0][2])


#: The blocks of a promotion's spans: it moves chunks between tiers, none into the engine.
NO_BLOCKS = BlockSpan(())


class JobKind(Enum):
    STORE = "store"
    LOAD = "load"
    #: Read lower-tier chunks into their CPU slots and no further: a hit that needs
    #: them is then served as a CPU-tier hit, in the step that asks for it.
    PROMOTE = "promote"


class JobStatus(Enum):
    #: Every chunk of the job was stored / loaded.
    SUCCESS = "success"
    #: Some chunks failed; ``failed_keys`` / ``failed_blocks`` name them.
    PARTIAL = "partial"
    #: No chunk succeeded.
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One group's part of a job: ``keys[i]`` lives in CPU slot ``slots[i]``.

    ``blocks`` are the engine blocks of those chunks; ``blocks.first_offset``
    lets a load begin inside its first chunk. A store's blocks cover whole
    chunks.
    """

    group: int
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    blocks: BlockSpan


@dataclass(frozen=True, slots=True)
class JobResult:
    """How one job ended; reported once by ``get_finished``."""

    job_id: int
    kind: JobKind
    status: JobStatus
    #: Chunks stored (store) or handed to the engine (load).
    done_keys: tuple[bytes, ...]
    failed_keys: tuple[bytes, ...]
    #: Load only: group -> engine block ids that were *not* loaded; recompute them.
    failed_blocks: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    #: Load only: chunks read from a lower tier into their CPU slot; complete their
    #: ``prepare_store`` in the index with these (the rest of it failed).
    promoted_keys: tuple[bytes, ...] = ()
    #: One line per failure, tier or transfer, for logs.
    errors: tuple[str, ...] = ()
    #: Bytes copied between engine tensors and CPU slots.
    bytes_moved: int = 0
    #: From submission to the result: what the job's request waited (queueing included).
    seconds: float = 0.0


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
    #: Load only: the engine schedules the request in the step this order comes with, so
    #: the worker finishes the load before the forward pass reads the blocks, and the
    #: request is not reported as finished receiving (it never waited).
    in_step: bool = False
    #: In-step load only: recurrent group -> the block the forward pass reads the
    #: request's running state from. vLLM copies the hit's state block there before
    #: the worker's ``start_load_kv``, so the worker writes the state there as well.
    running_states: Mapping[int, int] = field(default_factory=dict)

    @property
    def keys(self) -> tuple[bytes, ...]:
        if len(self.spans) == 1:  # most orders: one run of chunks
            return tuple(self.spans[0].keys)  # the same tuple, not a copy
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
