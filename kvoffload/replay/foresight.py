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
not know when a next turn comes, so it keeps what it takes for continued for
:data:`GUESSED_KEEP_S`.

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

__all__ = ["DROP_PRIORITY", "GUESSED_KEEP_S", "KEEP_PRIORITY", "MARGIN_S", "trace_hints"]

#: TensorRT-LLM's scale runs from 0 to 100 with 35 the default: well above it, and below.
KEEP_PRIORITY = 90
DROP_PRIORITY = 10
#: How long past the next turn's arrival a kept part stays: about the longest queue wait.
MARGIN_S = 60.0
#: How long a client that cannot see the future keeps a conversation it believes goes on
#: (a chat session's idle time: in the Mooncake conversation trace a turn is continued after
#: 5 minutes idle 14% of the time, after 20 minutes 2%).
GUESSED_KEEP_S = 600.0

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
    rng = random.Random(seed)
    uses = next_uses(trace.requests)
    seen: set[bytes] = set()
    hints: list[Params | None] = []
    for i, keys in enumerate(trace.requests):
        new, full = _leading(keys, seen.__contains__), _full_blocks(trace, i)
        seen.update(keys)
        if new >= full:
            hints.append(None)
            continue
        read = min(full, _leading(uses[i], NEVER.__ne__))  # what later requests read again
        hints.append(_said(trace, i, (new, read), uses[i], (accuracy, rng)))
    return hints


def _said(
    trace: Trace,
    i: int,
    parts: tuple[int, int],
    uses: Sequence[int],
    client: tuple[float, random.Random],
) -> Params:
    """What the client (its accuracy, its draws) says of request ``i`` whose blocks from
    ``parts[0]`` are new and whose first ``parts[1]`` blocks a later request reads again."""
    (new, read), (accuracy, rng) = parts, client
    size = trace.block_tokens
    continued = read > new
    if accuracy < 1:  # it knows only whether the conversation goes on, and may be wrong
        if rng.random() >= accuracy:
            continued = not continued
        if continued:
            return _hint((new * size, None, KEEP_PRIORITY, round(GUESSED_KEEP_S * 1000)))
        return _hint((new * size, None, DROP_PRIORITY, None))
    if not continued:
        return _hint((new * size, None, DROP_PRIORITY, None))
    wait = trace.arrivals[uses[read - 1]] - trace.arrivals[i] + MARGIN_S
    keep = (new * size, read * size, KEEP_PRIORITY, max(1, round(wait * 1000)))
    rest = (read * size, None, DROP_PRIORITY, None)
    return _hint(keep, rest) if read < _full_blocks(trace, i) else _hint(keep)


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
