"""Records of the worker side: what a job is given and how it ended.

Plain frozen dataclasses and enums, no behaviour beyond building a result:
they cross from the engine to the connector and into logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from kvoffload.transfer import BlockSpan

__all__ = ["ChunkSpan", "JobKind", "JobResult", "JobStatus", "Outcome"]


class JobKind(Enum):
    STORE = "store"
    LOAD = "load"


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


@dataclass(slots=True)
class Outcome:
    """What a job accumulates while it runs (engine-internal)."""

    done: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    failed_blocks: dict[int, list[int]] = field(default_factory=dict)
    promoted: list[bytes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    nbytes: int = 0

    def result(self, job_id: int, kind: JobKind) -> JobResult:
        if not self.failed:
            status = JobStatus.SUCCESS
        else:
            status = JobStatus.PARTIAL if self.done else JobStatus.FAILED
        blocks = {g: tuple(ids) for g, ids in self.failed_blocks.items()}
        return JobResult(job_id, kind, status, tuple(self.done), tuple(self.failed), blocks,
                         tuple(self.promoted), tuple(self.errors), self.nbytes)  # fmt: skip
