"""The engine's job book: job ids, the locks that keep jobs on one chunk apart, and the counts.

Jobs run on the engine's threads, and loads in the step on the thread that runs
the forward pass (:mod:`._layered`). Both take their ids, locks and counts
here, so the engine's waits cover every job, whichever way it runs. The locks
are :mod:`._locks`: a job waits only for earlier jobs of its own chunks or slots.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

from kvoffload.engine._locks import Held, JobLocks
from kvoffload.messages import ChunkSpan, JobKind, JobResult

__all__ = ["Held", "JobBook"]


def _names(spans: Sequence[ChunkSpan]) -> set[tuple[str, bytes | int]]:
    """What a job touches: each chunk key and each CPU slot of its spans."""
    names: set[tuple[str, bytes | int]] = {("k", k) for s in spans for k in s.keys}
    return names | {("s", slot) for s in spans for slot in s.slots}


class JobBook:
    """Ids, job locks, and the pending, queued, reading and loading counts of an engine's jobs."""

    def __init__(self) -> None:
        self.locks = JobLocks()
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._finished: list[JobResult] = []
        self._pending = 0  # every job not ended, loads in the step included
        self._queued = 0  # jobs on the engine's threads (or waiting for their chunks)
        self._reading = 0  # store jobs still reading engine blocks
        self._loading = 0  # load jobs running on the engine's threads

    def new_id(self) -> int:
        return next(self._ids)

    def locked(self, spans: Sequence[ChunkSpan]) -> Held:
        """Wait in this thread for the job locks of ``spans``' keys and slots, and hold them."""
        return self.locks.acquire(_names(spans))

    def admit(self, spans: Sequence[ChunkSpan], start: Callable[[Held], None]) -> None:
        """Call ``start`` with the job locks of ``spans`` once they are free (:mod:`._locks`)."""
        self.locks.admit(_names(spans), start)

    def begin(self, kind: JobKind, *, queued: bool = True) -> None:
        """A job of ``kind`` is pending; a store also reads engine blocks until it lets them go.

        ``queued``: it runs on the engine's threads, and ends by :meth:`end`; a load in
        the step is not, and ends by :meth:`end_unqueued`.
        """
        with self._cond:
            self._pending += 1
            self._queued += queued
            self._reading += kind is JobKind.STORE

    def sources_released(self) -> None:
        """A store job has copied its engine blocks out: the engine may reuse them."""
        with self._cond:
            self._reading -= 1
            self._cond.notify_all()

    def end(self, result: JobResult) -> None:
        """A queued job ended; its result waits in :meth:`take_finished`."""
        with self._cond:
            self._finished.append(result)
            self._pending -= 1
            self._queued -= 1
            self._cond.notify_all()

    def end_unqueued(self) -> None:
        """A job ended whose results its caller hands on itself (a load in the step's)."""
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def load_started(self) -> None:
        """A load job runs on a job thread: promotions wait for it (:meth:`wait_for_loads`)."""
        with self._cond:
            self._loading += 1

    def load_ended(self) -> None:
        """A load job of :meth:`load_started` is done: the last one lets promotions read."""
        with self._cond:
            self._loading -= 1
            if not self._loading:
                self._cond.notify_all()

    def wait_for_loads(self) -> None:
        """Block until no load job runs: a promotion reads with what the loads leave.

        Never a deadlock: a running load holds every job lock it needs already, and a
        promotion waits here before a read, not inside one (see the engine's "Threads").
        """
        with self._cond:
            self._cond.wait_for(lambda: self._loading == 0)

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

    def wait_queued(self) -> None:
        """Block until every queued job has ended (those waiting for their chunks included)."""
        with self._cond:
            self._cond.wait_for(lambda: self._queued == 0)
