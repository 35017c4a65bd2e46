"""The worker side: asynchronous store and load jobs; see :mod:`.engine`."""

from kvoffload.engine._layered import CopyMode, LayeredLoad
from kvoffload.engine.engine import OffloadEngine
from kvoffload.messages import ChunkSpan, JobKind, JobResult, JobStatus

__all__ = [
    "ChunkSpan",
    "CopyMode",
    "JobKind",
    "JobResult",
    "JobStatus",
    "LayeredLoad",
    "OffloadEngine",
]
