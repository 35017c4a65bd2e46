"""The hand-off between a prefill engine and a decode engine, on the scheduler side.

A producer (``kv_producer``) marks the chunks of every store it plans in the shared
tier, before the forward pass that computes them, and takes the marks back when the
store job reports; a consumer (``kv_consumer``) whose hit stops short of its prompt
answers vLLM "ask again" while a chunk past the hit is marked, until the chunk has
landed (the next lookup finds it) or ``handoff_wait_ms`` has passed since the
request first waited (then it loads what is there and computes the rest). Why the
marks, and where they live: :mod:`kvoffload.tiers.handoff`.

Only whole chunks are waited for: the tokens after a prompt's last whole chunk are
the consumer's to compute, as after any hit. On a recurrent hybrid at more than one
block per chunk, a prompt's hit may be a *tail* inside the chunk after its last whole
one (its states at its last block boundary, :mod:`kvoffload.connector._tails`), stored
under keys of their own: a marked tail there is waited for too, and may be all that is
on its way (a producer that holds the chunks below it stores the tail alone).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

from kvoffload.config import OffloadConfig
from kvoffload.connector._request import RequestState
from kvoffload.connector._tails import Tails
from kvoffload.connector.requests import Lookup
from kvoffload.connector.stats import SchedulerStats
from kvoffload.messages import JobKind, TransferOrder
from kvoffload.tiers.handoff import HandoffBoard

__all__ = ["Handoffs"]

logger = logging.getLogger("kvoffload")


class Handoffs:
    """A producer's marks and a consumer's waits over ``board``, counted in ``stats``.

    ``wait_s``: a consumer's longest wait for one request. ``clock``: seconds, monotonic.
    A failure to mark, and a wait that ran out, are logged the first time and counted
    every time.
    """

    def __init__(
        self,
        board: HandoffBoard,
        tokens_per_chunk: Sequence[int],
        wait_s: float,
        stats: SchedulerStats,
        *,
        marks: bool,
        tails: Tails | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.board = board
        self.tokens_per_chunk = tuple(tokens_per_chunk)
        #: Where a layout's hits may be tails (a consumer waits for those too); falsy: none.
        self.tails = tails if tails else None
        self.wait_s = wait_s
        #: A producer's: it marks its stores. Otherwise a consumer's: it waits for marks.
        self.marks = marks
        self._stats = stats
        self._clock = clock
        self._warned_mark = self._warned_wait = False

    @classmethod
    def from_config(
        cls,
        config: OffloadConfig,
        board: HandoffBoard | None,
        stats: SchedulerStats,
        tails: Tails | None = None,
    ) -> Handoffs | None:
        """A split role's hand-off over ``board`` (``None`` without one)."""
        if board is None:
            return None
        wait_s, spans = config.handoff_wait_ms / 1000, config.tokens_per_chunk
        return cls(board, spans, wait_s, stats, marks=config.announces_stores, tails=tails)

    # -- a producer's side ----------------------------------------------------------
    def mark(self, orders: Iterable[TransferOrder]) -> None:
        """Mark the chunks of this step's store orders, before the step runs them."""
        if not self.marks:
            return
        keys = [key for order in orders if order.kind is JobKind.STORE for key in order.keys]
        if not keys:
            return
        failed = self.board.announce(keys)
        self._stats.handoff_marked_chunks += len(keys) - failed
        if failed:
            self._stats.handoff_mark_failures += failed
            if not self._warned_mark:
                self._warned_mark = True
                logger.warning(
                    "kvoffload: %d of %d hand-off marks could not be written to the shared "
                    "tier: consumers may recompute what this producer is still storing "
                    "(counted in handoff_mark_failures)",
                    failed,
                    len(keys),
                )

    def unmark(self, order: TransferOrder) -> None:
        """A store job reported: its chunks landed or failed, so their marks may go."""
        if self.marks and order.kind is JobKind.STORE:
            self.board.withdraw(order.keys)

    # -- a consumer's side ----------------------------------------------------------
    def waits(self, lookup: Lookup, served: int) -> bool:
        """:meth:`should_wait` for ``lookup``, which can serve ``served`` tokens: its whole
        chunks past them, and the tails past them in the chunk after its last whole one."""
        tails = self.tails
        if tails is None:
            return self.should_wait(lookup.req, served, lookup.top)

        def past_tails() -> list[bytes]:
            out: list[bytes] = []
            for point in tails.candidates(lookup.keyable, lookup.top, served):
                keys = tails.keys(lookup.req, lookup.token_ids, lookup.block_hashes, point)
                out.extend(keys or ())
            return out

        return self.should_wait(lookup.req, served, lookup.top, past_tails)

    def should_wait(
        self,
        req: RequestState,
        served: int,
        top: int,
        tails: Callable[[], Sequence[bytes]] | None = None,
    ) -> bool:
        """Whether a lookup that can serve ``served`` of ``top`` tokens asks again instead.

        True while a whole chunk past ``served`` is marked, or a tail's key of
        ``tails()`` (asked only if no chunk is), for ``wait_s`` from the request's
        first wait; after that the request never waits again (a producer that
        stopped mid-store leaves marks until they lapse).
        """
        since = req.handoff_since
        if self.marks or (since is not None and math.isinf(since)):
            return False
        past = [
            key
            for group_keys, span in zip(req.keys, self.tokens_per_chunk, strict=True)
            for key in group_keys[served // span : top // span]
        ]
        if not self.board.announced(past) and (tails is None or not self.board.announced(tails())):
            return False
        now = self._clock()
        if since is None:
            req.handoff_since = now
            self._stats.handoff_waited_requests += 1
        elif now - since > self.wait_s:
            req.handoff_since = -math.inf  # never again for this request
            self._stats.handoff_timeouts += 1
            if not self._warned_wait:
                self._warned_wait = True
                logger.warning(
                    "kvoffload: a request waited %.1f s for chunks a producer marked as on "
                    "their way, which did not land; it computes them (handoff_wait_ms; a "
                    "producer that stopped mid-store? counted in handoff_timeouts)",
                    now - since,
                )
            return False
        self._stats.handoff_waits += 1
        return True
