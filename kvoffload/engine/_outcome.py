"""What a job accumulates while it runs, turned into the :class:`JobResult` it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.messages import JobKind, JobResult, JobStatus

__all__ = ["Outcome"]


@dataclass(slots=True)
class Outcome:
    """What a job accumulates while it runs (engine-internal)."""

    done: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    failed_blocks: dict[int, list[int]] = field(default_factory=dict)
    promoted: list[bytes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    nbytes: int = 0

    def result(self, job_id: int, kind: JobKind, seconds: float = 0.0) -> JobResult:
        if not self.failed:
            status = JobStatus.SUCCESS
        else:
            status = JobStatus.PARTIAL if self.done else JobStatus.FAILED
        blocks = {g: tuple(ids) for g, ids in self.failed_blocks.items()}
        return JobResult(
            job_id,
            kind,
            status,
            done_keys=tuple(self.done),
            failed_keys=tuple(self.failed),
            failed_blocks=blocks,
            promoted_keys=tuple(self.promoted),
            errors=tuple(self.errors),
            bytes_moved=self.nbytes,
            seconds=seconds,
        )
