"""The job locks: what keeps jobs on one chunk or one CPU slot apart, and nothing else.

A job names what it touches: each chunk key and each CPU slot of its spans. A
job that shares no name with any earlier unfinished job starts at once; one
that does starts once every earlier job it shares a name with has finished,
so jobs of one chunk or slot run one after the other, in the order they were
submitted. A job of other chunks and slots never waits for it, however long it
reads a slow disk, unless through an earlier job that shares names with both.

No deadlock: a job only ever waits for jobs submitted before it, and it takes
all its names at once, when every one is free and no earlier waiting job wants
one of them. A waiting job holds nothing, so it delays only jobs that share a
name with it.

No thread waits here for a job on the engine's threads: it is *admitted*
(:meth:`JobLocks.admit`) and handed to its thread by whichever call freed its
last name, so a thread that could copy a store's blocks out never sits behind
a job it does not conflict with. Only a load in the step waits, in the forward
pass's thread (:meth:`JobLocks.acquire`), and only for jobs of its own chunks.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable

__all__ = ["Held", "JobLocks"]


class Held:
    """The names a job holds, until :meth:`close` (idempotent) frees them."""

    __slots__ = ("_locks", "_names")

    def __init__(self, locks: JobLocks, names: frozenset[Hashable]) -> None:
        self._locks: JobLocks | None = locks
        self._names = names

    def close(self) -> None:
        locks, self._locks = self._locks, None
        if locks is not None:
            locks.release(self._names)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JobLocks:
    """Names held by running jobs, and the jobs waiting for theirs, in submission order."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held: set[Hashable] = set()
        #: Waiting jobs, oldest first: their names, and what starts each once admitted.
        self._waiting: list[tuple[frozenset[Hashable], Callable[[Held], None]]] = []
        self._wanted = Counter[Hashable]()  # the names of the waiting jobs

    def admit(self, names: Iterable[Hashable], start: Callable[[Held], None]) -> None:
        """Call ``start(held)`` once ``names`` are free of earlier jobs: now, in this thread,
        or later, in the thread whose :meth:`Held.close` frees the last of them."""
        wanted = frozenset(names)
        with self._mutex:
            free = wanted.isdisjoint(self._held) and not any(self._wanted[n] for n in wanted)
            if free:
                self._held |= wanted
            else:
                self._waiting.append((wanted, start))
                self._wanted.update(wanted)
        if free:
            start(Held(self, wanted))

    def acquire(self, names: Iterable[Hashable]) -> Held:
        """Wait in this thread until ``names`` are free of earlier jobs, then hold them."""
        given: list[Held] = []
        ready = threading.Event()

        def start(held: Held) -> None:
            given.append(held)
            ready.set()

        self.admit(names, start)
        ready.wait()
        return given[0]

    def release(self, names: frozenset[Hashable]) -> None:
        """Free ``names`` and start the waiting jobs that then hold all of theirs."""
        with self._mutex:
            self._held -= names
            admitted = self._admit_waiting()
        for held, start in admitted:
            start(held)

    def _admit_waiting(self) -> list[tuple[Held, Callable[[Held], None]]]:
        """The waiting jobs whose names are free now, oldest first; the caller holds the mutex.

        A job is passed over while an older waiting job wants one of its names.
        """
        admitted, still, blocked = [], [], set[Hashable]()
        for names, start in self._waiting:
            if names.isdisjoint(self._held) and names.isdisjoint(blocked):
                self._held |= names
                self._wanted.subtract(names)
                admitted.append((Held(self, names), start))
            else:
                blocked |= names
                still.append((names, start))
        self._waiting = still
        if admitted:
            self._wanted = +self._wanted  # drops the names no job waits for now
        return admitted

    def idle(self) -> bool:
        """Whether no job holds or waits for a name (the tests' check that all were freed)."""
        with self._mutex:
            return not self._held and not self._waiting
