"""Write-behind for a slow lower tier: a bounded queue and one writer thread.

A store job hands a chunk to :meth:`WriteBehind.submit`, which stages a
private copy at once (``Tier.stage_put``: the CPU slot may be evicted and
reused as soon as the job reports done, so nothing reads it later) and
queues the write. The job does not wait for the network.

What can go wrong, and where it is reported:

* **Refused at submit** (the queue already holds ``max_bytes``, the tier is
  known to be down, the queue is closed): ``submit`` raises ``TierError``, so
  the store job names the failure in ``JobResult.errors``; it is also counted
  (``dropped``, the tier's ``store_failures``, the cascade's traffic).
* **Failed in the background** (the server died after the chunk was queued,
  refused it, timed out): counted in ``failed``, in the tier's own
  counters and in the cascade's traffic as a failed store; the first failure
  of a run of them is logged as a warning on the ``kvoffload`` logger (the
  tier logs the outage itself once), later ones only counted until a write
  succeeds again.

Nothing blocks the engine: ``submit`` never waits for room, and a write
takes at most the tier's own call timeout. ``close`` drains what is queued
for a bounded time and counts whatever it had to leave as dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from kvoffload.errors import TierError
from kvoffload.tiers.base import ChunkBuffer, Tier

__all__ = ["WriteBehind"]

logger = logging.getLogger("kvoffload")

#: Called after every write: (ok, payload bytes, seconds). The cascade counts traffic with it.
Report = Callable[[bool, int, float], None]


@dataclass(slots=True)
class _Counters:
    queued: int = 0
    written: int = 0
    written_bytes: int = 0
    failed: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    queue_bytes: int = 0
    queue_peak_bytes: int = 0


class WriteBehind:
    """Writes chunks to ``tier`` from a queue of at most ``max_bytes`` staged bytes.

    At least one chunk is always accepted when the queue is empty, so a
    bound below one chunk does not silently stop all writes (the
    configuration refuses such a bound anyway). The writer thread starts
    with the first chunk, so building one costs nothing.
    """

    def __init__(self, tier: Tier, max_bytes: int, report: Report) -> None:
        self.tier = tier
        self.max_bytes = max_bytes
        self._report = report
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, Callable[[], None], int]] = deque()
        self._writing = 0
        self._counters = _Counters()
        self._failing = False  # inside a run of failures: warned once already
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, key: bytes, data: ChunkBuffer) -> None:
        """Stage a copy of ``data`` and queue its write; ``TierError`` (counted) if refused."""
        nbytes = data.nbytes
        with self._cond:
            reason = self._refusal(nbytes)
            if reason is None:
                self._counters.queue_bytes += nbytes  # reserved while staging
        if reason is not None:
            self._drop(nbytes, reason)
        try:
            write = self.tier.stage_put(key, data)
        except TierError as exc:
            with self._cond:
                self._counters.queue_bytes -= nbytes
            self._drop(nbytes, str(exc), warn=False)
        with self._cond:
            c = self._counters
            self._queue.append((key, write, nbytes))
            c.queued += 1
            c.queue_peak_bytes = max(c.queue_peak_bytes, c.queue_bytes)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"kvoffload-{self.tier.name}-writer", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued write finished (written or failed) and was reported.

        ``False`` on timeout.
        """
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._writing, timeout)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            stats: dict[str, Any] = asdict(self._counters)
        stats["max_bytes"] = self.max_bytes
        return stats

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new writes, finish queued ones for up to ``timeout`` s, drop the rest."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.drain(timeout)
        with self._cond:
            left, self._queue = list(self._queue), deque()
            for _, _, nbytes in left:
                self._counters.dropped += 1
                self._counters.dropped_bytes += nbytes
                self._counters.queue_bytes -= nbytes
            self._cond.notify_all()
        for _, _, nbytes in left:
            self._report(False, nbytes, 0.0)
        if left:
            logger.warning(
                "kvoffload: closing the %s tier dropped %d queued writes", self.tier.name, len(left)
            )
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # -- internals ----------------------------------------------------------
    def _refusal(self, nbytes: int) -> str | None:
        """Why a chunk of ``nbytes`` cannot be queued now, or ``None``; caller holds the lock."""
        if self._closed:
            return "its write queue is closed"
        used = self._counters.queue_bytes
        if used and used + nbytes > self.max_bytes:
            return (
                f"its write queue is full ({used} B queued, {nbytes} B more would pass "
                f"remote_queue_bytes {self.max_bytes} B)"
            )
        return None

    def _drop(self, nbytes: int, reason: str, *, warn: bool = True) -> NoReturn:
        with self._cond:
            self._counters.dropped += 1
            self._counters.dropped_bytes += nbytes
            first = warn and not self._failing
            self._failing = self._failing or warn
        self._report(False, nbytes, 0.0)
        if first:
            logger.warning(
                "kvoffload: %s tier store dropped: %s; further failures are counted in stats "
                "until a write succeeds",
                self.tier.name,
                reason,
            )
        raise TierError(f"{self.tier.name} store not queued: {reason}")

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                key, write, nbytes = self._queue.popleft()
                self._writing += 1
            start = time.perf_counter()
            ok, error = True, ""
            try:
                write()
            except Exception as exc:  # a tier raises TierError; anything else is still counted
                ok, error = False, f"{type(exc).__name__}: {exc}"
            self._finished(key, nbytes, ok, error, time.perf_counter() - start)

    def _finished(self, key: bytes, nbytes: int, ok: bool, error: str, seconds: float) -> None:
        with self._cond:
            c = self._counters
            c.queue_bytes -= nbytes
            if ok:
                c.written += 1
                c.written_bytes += nbytes
            else:
                c.failed += 1
            first_failure = not ok and not self._failing
            self._failing = not ok
        try:
            self._report(ok, nbytes, seconds)
            if first_failure:
                logger.warning(
                    "kvoffload: background write of chunk %s to the %s tier failed (%s); "
                    "further failures are counted in stats until a write succeeds",
                    key.hex()[:16],
                    self.tier.name,
                    error,
                )
        finally:
            with self._cond:  # only now is the write done for drain(): counted, reported, logged
                self._writing -= 1
                self._cond.notify_all()
