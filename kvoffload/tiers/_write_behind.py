"""Write-behind for a slow lower tier: a bounded queue and one writer thread, itself a ``Tier``.

:class:`WriteBehind` wraps a network tier (the remote tier) so that the
cascade treats it like any other lower tier: ``put`` stages a private copy at
once (the tier's ``stage_put``: the CPU slot may be evicted and reused as soon
as the store job reports done, so nothing reads it later) and queues the
write; loads, probes and discards go straight to the tier. The store job does
not wait for the network.

Why ``stage_put`` and not ``data.copy()`` then ``put``: the remote tier packs
each chunk into one record (header and payload) anyway, so staging *is* that
packing, the one copy out of the slot; a plain copy first would be a second
copy of every chunk. It also lets a tier refuse at once (a server known to be
down), so the job names the failure and no memory is queued for it.

What can go wrong, and where it is counted (each once; see
:mod:`kvoffload.tiers.stats`):

* **Refused by the queue** (it already holds ``max_bytes``, or it is closed):
  ``put`` raises ``TierError``, so the store job names the failure in
  ``JobResult.errors``; counted in ``dropped``. Refused by the tier while
  staging: raised the same way, counted by the tier as a failed store.
* **Failed in the background** (the server died after the chunk was queued,
  refused it, timed out): counted by the tier as a failed store; the first
  failure of a run of them is logged as a warning on the ``kvoffload``
  logger (the tier logs the outage itself once), later ones only counted
  until a write succeeds again.
* **Left in the queue at close**: counted in ``dropped``.

Nothing blocks the engine: ``put`` never waits for room, and a write takes at
most the tier's own call timeout. ``close`` drains what is queued for a
bounded time, then closes the tier.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import NoReturn, Protocol

from kvoffload.errors import ConfigError, TierError
from kvoffload.tiers.base import ChunkBuffer, Tier, WrappedTier
from kvoffload.tiers.stats import TierCounters, TierStats

__all__ = ["StagedTier", "WriteBehind"]

logger = logging.getLogger("kvoffload")


class StagedTier(Protocol):
    """A tier that can copy a chunk now and store the copy later (the remote tier)."""

    name: str

    def stage_put(self, key: bytes, data: ChunkBuffer) -> Callable[[], None]: ...


class WriteBehind(WrappedTier):
    """``tier`` written from a queue of at most ``max_bytes`` staged bytes; see the module doc.

    At least one chunk is always accepted when the queue is empty, so a
    bound below one chunk does not silently stop all writes (the
    configuration refuses such a bound anyway). The writer thread starts
    with the first chunk, so building one costs nothing.
    """

    def __init__(self, tier: Tier, max_bytes: int) -> None:
        if not callable(getattr(tier, "stage_put", None)):
            raise ConfigError(f"write-behind needs a tier with stage_put (remote), got {tier!r}")
        super().__init__(tier)
        self.max_bytes = max_bytes
        self._staged: StagedTier = tier  # type: ignore[assignment]
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, Callable[[], None], int]] = deque()
        self._writing = 0
        self._queue_bytes = 0
        self._peak_bytes = 0
        self._counters = TierCounters(self.name, ("queued",))
        self._failing = False  # inside a run of failures: warned once already
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, key: bytes, data: ChunkBuffer) -> None:
        """Stage a copy of ``data`` and queue its write; ``TierError`` if refused."""
        nbytes = data.nbytes
        with self._cond:
            reason = self._refusal(nbytes)
            if reason is None:
                self._queue_bytes += nbytes  # reserved while staging
        if reason is not None:
            self._counters.add(dropped=1)
            self._refused(reason)
        try:
            write = self._staged.stage_put(key, data)  # counted by the tier if it refuses
        except TierError as exc:
            with self._cond:
                self._queue_bytes -= nbytes
            raise TierError(f"{self.name} store not queued: {exc}") from exc
        with self._cond:
            closed = self._closed  # closed while this chunk was staged: too late to queue
            if closed:
                self._queue_bytes -= nbytes
            else:
                self._enqueue(key, write, nbytes)
        if closed:
            self._counters.add(dropped=1)
            self._refused("its write queue is closed")
        self._counters.add(queued=1)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued write finished (stored or failed) and was logged.

        ``False`` on timeout.
        """
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._writing, timeout)

    def stats(self) -> TierStats:
        """The tier's stats, with the queue's: ``dropped``, ``queued`` and its byte gauges."""
        inner, mine = self.tier.stats(), self._counters.snapshot()
        with self._cond:
            gauges = {
                "queue_bytes": self._queue_bytes,
                "queue_peak_bytes": self._peak_bytes,
                "queue_max_bytes": self.max_bytes,
            }
        return dataclasses.replace(
            inner,
            dropped=inner.dropped + mine.dropped,
            counters={**inner.counters, **mine.counters},
            gauges={**inner.gauges, **gauges},
        )

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new writes, finish queued ones for up to ``timeout`` s, drop the rest, close."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.drain(timeout)
        with self._cond:
            left, self._queue = list(self._queue), deque()
            self._queue_bytes -= sum(nbytes for _, _, nbytes in left)
            self._cond.notify_all()
        if left:
            self._counters.add(dropped=len(left))
            logger.warning(
                "kvoffload: closing the %s tier dropped %d queued writes", self.name, len(left)
            )
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self.tier.close()

    # -- internals ----------------------------------------------------------
    def _enqueue(self, key: bytes, write: Callable[[], None], nbytes: int) -> None:
        """Queue a staged write, wake the writer (started on first use); caller holds the lock."""
        self._queue.append((key, write, nbytes))
        self._peak_bytes = max(self._peak_bytes, self._queue_bytes)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kvoffload-{self.name}-writer", daemon=True
            )
            self._thread.start()
        self._cond.notify_all()

    def _refusal(self, nbytes: int) -> str | None:
        """Why a chunk of ``nbytes`` cannot be queued now, or ``None``; caller holds the lock."""
        if self._closed:
            return "its write queue is closed"
        used = self._queue_bytes
        if used and used + nbytes > self.max_bytes:
            return (
                f"its write queue is full ({used} B queued, {nbytes} B more would pass "
                f"remote_queue_bytes {self.max_bytes} B)"
            )
        return None

    def _refused(self, reason: str) -> NoReturn:
        with self._cond:
            first = not self._failing
            self._failing = True
        if first:
            logger.warning(
                "kvoffload: %s tier store dropped: %s; further failures are counted in stats "
                "until a write succeeds",
                self.name,
                reason,
            )
        raise TierError(f"{self.name} store not queued: {reason}")

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                key, write, nbytes = self._queue.popleft()
                self._writing += 1
            error = ""
            try:
                write()  # counts its own outcome in the tier's stats
            except Exception as exc:  # a tier raises TierError; anything else is counted too
                error = f"{type(exc).__name__}: {exc}"
            self._finished(key, nbytes, error)

    def _finished(self, key: bytes, nbytes: int, error: str) -> None:
        with self._cond:
            self._queue_bytes -= nbytes
            first_failure = bool(error) and not self._failing
            self._failing = bool(error)
        try:
            if first_failure:
                logger.warning(
                    "kvoffload: background write of chunk %s to the %s tier failed (%s); "
                    "further failures are counted in stats until a write succeeds",
                    key.hex()[:16],
                    self.name,
                    error,
                )
        finally:
            with self._cond:  # only now is the write done for drain(): counted and logged
                self._writing -= 1
                self._cond.notify_all()
