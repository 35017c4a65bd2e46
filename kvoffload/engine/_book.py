"""The engine's job book: job ids, the locks that keep jobs on one chunk apart, and the counts.

Jobs run on the engine's pool, and loads in the step on the thread that runs
the forward pass (:mod:`._layered`). Both take their ids, locks and counts
here, so the engine's waits cover every job, whichever way it runs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from contextlib import ExitStack

from kvoffload.messages import ChunkSpan, JobKind, JobResult

__all__ = ["JobBook"]

#: Enough that jobs on different chunks rarely share a lock, few enough to take in one sweep.
_LOCK_STRIPES = 64


class JobBook:
    """Ids, striped locks, and the pending and reading counts of an engine's jobs."""

    def __init__(self) -> None:
        self._locks = [threading.Lock() for _ in range(_LOCK_STRIPES)]
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._finished: list[JobResult] = []
        self._pending = 0
        self._reading = 0  # store jobs still reading engine blocks

    def new_id(self) -> int:
        return next(self._ids)

    def locked(self, spans: Sequence[ChunkSpan]) -> ExitStack:
        """The job locks over ``spans``' keys and slots, taken in one sorted order.

        One order for every job, so two jobs never each hold a lock the other waits for.
        """
        stripes = {hash(("k", k)) % _LOCK_STRIPES for s in spans for k in s.keys}
        stripes |= {hash(("s", slot)) % _LOCK_STRIPES for s in spans for slot in s.slots}
        stack = ExitStack()
        for stripe in sorted(stripes):
            stack.enter_context(self._locks[stripe])
        return stack

    def begin(self, kind: JobKind) -> None:
        """A job of ``kind`` is pending; a store also reads engine blocks until it lets them go."""
        with self._cond:
            self._pending += 1
            self._reading += kind is JobKind.STORE

    def sources_released(self) -> None:
        """A store job has copied its engine blocks out: the engine may reuse them."""
        with self._cond:
            self._reading -= 1
            self._cond.notify_all()

    def end(self, result: JobResult) -> None:
        """A pool job ended; its result waits in :meth:`take_finished`."""
        with self._cond:
            self._finished.append(result)
            self._pending -= 1
            self._cond.notify_all()

    def end_unqueued(self) -> None:
        """A job ended whose results its caller hands on itself (a load in the step's)."""
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def take_finished(self) -> list[JobResult]:
        """Results queued since the last call, each handed out exactly once."""
        with self._cond:
            done, self._finished = self._finished, []
        return done

    def wait_for_sources(self, timeout: float | None) -> bool:
        """Block until no store job reads engine blocks; ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._reading == 0, timeout)

    def wait_for_any(self, timeout: float | None) -> bool:
        """Block until a result is queued or no job is pending; ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._finished) or self._pending == 0, timeout)

    def wait(self, timeout: float | None) -> bool:
        """Block until no job is pending; ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)
