"""Conversation turns on the package's stand-in engine over a small CPU tier, for the tests
of what the queue and the client keep (``test_queued``, ``test_hints``)."""

from __future__ import annotations

import random
from typing import Any

from kvoffload.standin import KVOffloadSide, StandIn


def tokens(seed: int, n: int) -> list[int]:
    """``n`` prompt tokens, the same for the same ``seed``: a turn's text."""
    return random.Random(seed).choices(range(1, 30000), k=n)


def run_out(stand: StandIn, side: KVOffloadSide) -> dict[str, Any]:
    """Serve every request added to the end, each loaded block checked bit-exact and no load
    failed; the scheduler's stats."""
    stand.run([])
    assert stand.stats.mismatched_blocks == 0 and stand.stats.failed_load_tokens == 0
    return side.scheduler.stats()
