"""Retention hints from a trace's own future: what a client that knows its conversations says.

A chat client knows more than the cache does: whether the user is still in the
conversation, or has closed it. The arrival replay stands in for such a client with
the trace's knowledge. Each request adds a *new part* to what earlier requests held
(the blocks no earlier request had: a turn's question and the answer before it); the
client says whether a later request reads that part again:

* **continues**: keep what of the new part a later request reads (priority
  :data:`KEEP_PRIORITY`) until that request arrives, plus :data:`MARGIN_S` for the time
  it may queue, and drop the rest;
* **ends**: drop the new part (priority :data:`DROP_PRIORITY`) from the CPU tier.

What earlier requests already held (a system prompt, the conversation so far) is left
to the eviction policy: its own hint came when it was new. ``accuracy`` below 1 is a
client that knows less: it is wrong that often (drawn from a fixed seed), and it does
not know when a next turn comes, so it keeps what it takes for continued for the
trace's median time between a turn and the next (what a client learns from its own
history: 126 s on the Mooncake conversation trace; :func:`typical_gap`).

The hints are in the shape :mod:`kvoffload.connector.hints` parses from vLLM's
``kv_transfer_params``, so the replay goes through the connector's own parser.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvoffload.errors import ConfigError
from kvoffload.replay.belady import NEVER, next_uses
from kvoffload.replay.trace import Trace

__all__ = ["DROP_PRIORITY", "KEEP_PRIORITY", "MARGIN_S", "trace_hints", "typical_gap"]

#: TensorRT-LLM's scale runs from 0 to 100 with 35 the default: well above it, and below.
KEEP_PRIORITY = 90
DROP_PRIORITY = 10
#: How long past the next turn's arrival a kept part stays: about the longest queue wait.
MARGIN_S = 60.0

Params = dict[str, object]
T = TypeVar("T")


def trace_hints(trace: Trace, accuracy: float = 1.0, *, seed: int = 0) -> list[Params | None]:
    """Per request, the ``kv_transfer_params`` a client with ``accuracy`` would send.

    ``None`` for a request that adds no whole block to what came before (nothing of
    its own to keep or drop). Raises ``ConfigError`` for a trace without arrival times
    (a kept part lasts until the next turn arrives) or an accuracy outside (0, 1].
    """
    if not 0 < accuracy <= 1:
        raise ConfigError(f"hint accuracy {accuracy!r} is not in (0, 1]: give e.g. 0.8")
    if not trace.arrivals:
        raise ConfigError(
            f"trace {trace.name!r} has no 'timestamp' on every request: hints from the "
            "trace keep a turn until the next one arrives, so they need arrival times"
        )
    uses = next_uses(trace.requests)
    parts = _parts(trace, uses)
    guess = _median([gap for _, _, gap in parts if gap is not None]) if accuracy < 1 else 0.0
    rng = random.Random(seed)
    hints: list[Params | None] = [None] * len(trace.requests)
    for i, (new, read, gap) in enumerate(parts):
        full = _full_blocks(trace, i)
        if new < full:
            part = (new, read, gap, read < full)
            hints[i] = _said(trace.block_tokens, part, (accuracy, rng, guess))
    return hints


def typical_gap(trace: Trace) -> float:
    """The median seconds between a turn and the next request that reads its new part."""
    gaps = [gap for _, _, gap in _parts(trace, next_uses(trace.requests)) if gap is not None]
    return _median(gaps)


def _parts(trace: Trace, uses: list[list[int]]) -> list[tuple[int, int, float | None]]:
    """Per request: where its new part starts, how many leading blocks a later request
    reads again, and the seconds until the request that reads the last of them (``None``:
    no later request reads its new part)."""
    seen: set[bytes] = set()
    out: list[tuple[int, int, float | None]] = []
    for i, keys in enumerate(trace.requests):
        new, full = _leading(keys, seen.__contains__), _full_blocks(trace, i)
        seen.update(keys)
        read = min(full, _leading(uses[i], NEVER.__ne__))  # what later requests read again
        gap = trace.arrivals[uses[i][read - 1]] - trace.arrivals[i] if read > new else None
        out.append((new, read, gap))
    return out


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else MARGIN_S


def _said(
    size: int,
    part: tuple[int, int, float | None, bool],
    client: tuple[float, random.Random, float],
) -> Params:
    """What the client (its accuracy, its draws, its guess of a gap) says of a request
    whose blocks from ``part[0]`` are new, whose first ``part[1]`` blocks a later request
    reads again ``part[2]`` seconds on (and whose later blocks, if ``part[3]``, none does)."""
    (new, read, gap, rest), (accuracy, rng, guess) = part, client
    continued = gap is not None
    if accuracy < 1:  # it knows only whether the conversation goes on, and may be wrong
        if rng.random() >= accuracy:
            continued = not continued
        if continued:
            return _hint((new * size, None, KEEP_PRIORITY, round(guess * 1000)))
        return _hint((new * size, None, DROP_PRIORITY, None))
    if gap is None:
        return _hint((new * size, None, DROP_PRIORITY, None))
    keep = (new * size, read * size, KEEP_PRIORITY, max(1, round((gap + MARGIN_S) * 1000)))
    return _hint(keep, (read * size, None, DROP_PRIORITY, None)) if rest else _hint(keep)


def _leading(items: Sequence[T], test: Callable[[T], bool]) -> int:
    """How many leading ``items`` pass ``test`` (keys name their whole prefix, so what holds
    of a block holds of every block before it)."""
    n = 0
    for item in items:
        if not test(item):
            break
        n += 1
    return n


def _full_blocks(trace: Trace, i: int) -> int:
    """Whole blocks of request ``i``'s prompt: the chunks an engine can store of it."""
    keys = trace.requests[i]
    return trace.lengths[i] // trace.block_tokens if trace.lengths else len(keys)


def _hint(*token_ranges: tuple[int, int | None, int, int | None]) -> Params:
    """``kv_transfer_params`` of ranges (start, end, priority, duration_ms)."""
    out: list[dict[str, object]] = []
    for start, end, priority, duration_ms in token_ranges:
        entry: dict[str, object] = {"token_start": start, "token_end": end, "priority": priority}
        if duration_ms is not None:
            entry["duration_ms"] = duration_ms
        out.append(entry)
    return {"kv_retention": {"token_ranges": out}}
