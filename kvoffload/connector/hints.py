"""Retention hints: the client says which of a request's tokens are worth keeping.

A client often knows what the cache cannot: that a conversation has ended, or
that a document will be asked about again. It says so per request, in vLLM's
``kv_transfer_params`` (the OpenAI API's extra field, or ``SamplingParams.extra_args``),
in the shape TensorRT-LLM's ``KvCacheRetentionConfig`` gave and vLLM's and SGLang's
retention proposals copy: token ranges, each with a priority from 0 to 100 and an
optional duration::

    {"kv_retention": {"token_ranges": [
        {"token_start": 0, "token_end": 2048, "priority": 90, "duration_ms": 600000},
        {"token_start": 2048, "token_end": null, "priority": 10}]}}

kvoffload honours it in its CPU tier when the request finishes (and as its last
stores land): a range above the default priority (35, TensorRT-LLM's) is *kept*:
its chunks are held against eviction for ``duration_ms`` (at most an hour), from
the same bounded share as the chunks of queued requests
(:mod:`~kvoffload.connector.queued`), which a running request's store may still
take back, newest first; a range below it is *dropped* from the CPU tier at once
(the disk and remote tiers keep it). Chunks are named by keys that include the
request's tenant (its ``cache_salt``), so a hint reaches only its own tenant's
chunks. A hint that does not parse is ignored, with one warning naming what is
wrong and a count (``retention_hints_ignored``): never an error that fails the
request.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from kvoffload.config import OffloadConfig
from kvoffload.connector._request import RequestState
from kvoffload.connector.stats import SchedulerStats
from kvoffload.manager.index import OffloadIndex
from kvoffload.manager.results import Steer

__all__ = ["DEFAULT_PRIORITY", "RetentionHints", "TokenRange", "parse_hint", "steering"]

logger = logging.getLogger("kvoffload")

#: The priority of tokens no range names (TensorRT-LLM's default): neither kept nor dropped.
DEFAULT_PRIORITY = 35
#: The longest a kept range is held; also what a kept range without a duration gets.
MAX_KEEP_S = 3600.0
_MAX_RANGES = 64
_FIELD = "kv_retention"


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Tokens ``[start, end)`` (``end`` ``None``: to the end) at ``priority``, for ``seconds``."""

    start: int
    end: int | None
    priority: int
    seconds: float

    def covers(self, begin: int, stop: int) -> bool:
        """Whether the chunk of tokens ``[begin, stop)`` lies inside the range."""
        return begin >= self.start and (self.end is None or stop <= self.end)


def parse_hint(params: object) -> tuple[TokenRange, ...] | str | None:
    """The ranges of ``kv_transfer_params``'s retention hint; ``None`` without one, or why
    it is malformed (a string)."""
    if not isinstance(params, Mapping) or _FIELD not in params:
        return None
    hint = params[_FIELD]
    ranges = hint.get("token_ranges") if isinstance(hint, Mapping) else None
    if not isinstance(ranges, list) or not 0 < len(ranges) <= _MAX_RANGES:
        return f"'{_FIELD}' needs 'token_ranges': a list of 1 to {_MAX_RANGES} ranges"
    out = []
    for n, entry in enumerate(ranges):
        parsed = _range(entry)
        if isinstance(parsed, str):
            return f"'{_FIELD}' range {n}: {parsed}"
        out.append(parsed)
    return tuple(out)


def steering(
    hint: Sequence[TokenRange], chunks: Iterable[tuple[bytes, int]], spans: Sequence[int]
) -> Steer | None:
    """What a request's ``hint`` asks of the chunks a store is about to reserve: each a key
    and its chunk index, of ``spans[0]`` tokens (one group) or of ``spans[i]`` for the i-th.
    A chunk in a kept range is admitted past the policy's filter; one in a dropped range is
    not kept in the CPU tier (the lower tiers still get it). ``None``: nothing to steer."""
    if not hint:
        return None
    kept: set[bytes] = set()
    dropped: set[bytes] = set()
    one = spans[0] if len(spans) == 1 else None
    for i, (key, chunk) in enumerate(chunks):
        size = spans[i] if one is None else one
        priority = _priority(hint, chunk * size, (chunk + 1) * size)
        if priority > DEFAULT_PRIORITY:
            kept.add(key)
        elif priority < DEFAULT_PRIORITY:
            dropped.add(key)
    return Steer(frozenset(kept), frozenset(dropped)) if kept or dropped else None


def _priority(hint: Sequence[TokenRange], begin: int, stop: int) -> int:
    """The priority of the chunk of tokens ``[begin, stop)``: of the last range that covers
    it (a later range overrides an earlier one, as in TensorRT-LLM), else the default."""
    for tokens in reversed(hint):
        if tokens.covers(begin, stop):
            return tokens.priority
    return DEFAULT_PRIORITY


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(entry: object) -> TokenRange | str:
    if not isinstance(entry, Mapping):
        return "not an object"
    unknown = set(entry) - {"token_start", "token_end", "priority", "duration_ms"}
    if unknown:
        return f"unknown field(s) {sorted(map(str, unknown))}"
    start, end = entry.get("token_start", 0), entry.get("token_end")
    priority, duration = entry.get("priority"), entry.get("duration_ms")
    if not _is_int(start) or start < 0:
        return f"token_start must be an integer >= 0, got {start!r}"
    if end is not None and (not _is_int(end) or end <= start):
        return f"token_end must be null or an integer above token_start, got {end!r}"
    if not _is_int(priority) or not 0 <= priority <= 100:
        return f"priority must be an integer from 0 to 100, got {priority!r}"
    if duration is not None and (not _is_int(duration) or duration <= 0):
        return f"duration_ms must be null or an integer above 0, got {duration!r}"
    seconds = MAX_KEEP_S if duration is None else min(duration / 1000, MAX_KEEP_S)
    return TokenRange(start, end, priority, seconds)


class RetentionHints:
    """Applies requests' hints to ``index``: keeps (holds, within ``limit`` chunks held in
    all) and drops; lets kept ranges go when their time is up."""

    def __init__(
        self,
        index: OffloadIndex,
        tokens_per_chunk: Sequence[int],
        stats: SchedulerStats,
        *,
        limit: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.tokens_per_chunk = tuple(tokens_per_chunk)
        self._stats = stats
        self._limit = limit
        self._clock = clock
        #: (deadline, sequence) of each kept range, soonest first; its chunks by sequence
        #: (a range that made room for another leaves only the second).
        self._kept: list[tuple[float, int]] = []
        self._ranges: dict[int, list[bytes]] = {}
        #: (-deadline, sequence): the range whose time runs out last first.
        self._last: list[tuple[float, int]] = []
        self._count = 0  # chunks held, a chunk of two ranges twice
        self._sequence = 0
        self._warned = False

    @classmethod
    def from_config(
        cls,
        config: OffloadConfig,
        index: OffloadIndex,
        stats: SchedulerStats,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> RetentionHints:
        """The hints ``retention_cpu_share`` allows on ``index`` (none kept where nothing loads)."""
        limit = int(config.retention_cpu_share * index.capacity) if config.loads else 0
        return cls(index, config.tokens_per_chunk, stats, limit=limit, clock=clock)

    def read(self, req: RequestState | None, params: object) -> None:
        """Take the request's hint from its ``kv_transfer_params`` (once; ``req`` ``None``: a
        request not tracked, nothing to do)."""
        if req is None:
            return
        parsed = parse_hint(params)
        if isinstance(parsed, str):
            self._stats.retention_hints_ignored += 1
            if not self._warned:
                self._warned = True
                logger.warning(
                    "kvoffload: a retention hint was ignored (the request is served as "
                    "usual): %s; see docs/vllm.md, counted in retention_hints_ignored",
                    parsed,
                )
        elif parsed is not None:
            req.hint = parsed
            self._stats.retention_hints += 1

    def apply(self, req: RequestState, keys: Sequence[bytes] | None = None) -> None:
        """Keep or drop the request's CPU-tier chunks its hint names (of ``keys`` only: the
        chunks a store just landed; ``None``: all of the request's)."""
        if not req.hint:
            return
        only = None if keys is None else set(keys)
        for tokens in req.hint:
            chunks = [
                key
                for group_keys, span in zip(req.keys, self.tokens_per_chunk, strict=True)
                for c, key in enumerate(group_keys)
                if tokens.covers(c * span, (c + 1) * span) and (only is None or key in only)
            ]
            if tokens.priority > DEFAULT_PRIORITY:
                self._keep(chunks, tokens.seconds)
            elif tokens.priority < DEFAULT_PRIORITY:
                self._stats.retention_dropped_chunks += len(self.index.discard(chunks))

    def _keep(self, chunks: list[bytes], seconds: float) -> None:
        """Hold ``chunks`` for ``seconds``, within this share alone (the index holds for
        queued requests too). With no room left, the kept range whose time runs out last
        makes room for one whose time runs out sooner: the client said when each will be
        read again, and the sooner one is the better use of the room (Belady's)."""
        index, deadline = self.index, self._clock() + seconds
        ready = [key for key, here in zip(chunks, index.ready_mask(chunks), strict=True) if here]
        held = index.hold(ready, index.held + self._room())
        while len(held) < len(ready) and (last := self._latest()) is not None:
            if -last[0] <= deadline:
                break
            heapq.heappop(self._last)
            self._let_go(last[1])
            held += index.hold(ready[len(held) :], index.held + self._room())
        if held:
            self._sequence += 1
            self._ranges[self._sequence] = held
            self._count += len(held)
            heapq.heappush(self._kept, (deadline, self._sequence))
            heapq.heappush(self._last, (-deadline, self._sequence))
            self._stats.retention_kept_chunks += len(held)

    def _room(self) -> int:
        return max(0, self._limit - self._count)

    def _let_go(self, sequence: int) -> None:
        held = self._ranges.pop(sequence, None)
        if held is not None:
            self.index.unhold(held)
            self._count -= len(held)

    def _latest(self) -> tuple[float, int] | None:
        """(-deadline, sequence) of the kept range whose time runs out last, if any."""
        last = self._last
        while last and last[0][1] not in self._ranges:
            heapq.heappop(last)
        return last[0] if last else None

    def expire(self) -> None:
        """Let go of the kept ranges whose time is up (those made room for are gone)."""
        kept = self._kept
        if not kept:
            return
        now = self._clock()
        while kept and kept[0][0] <= now:
            self._let_go(heapq.heappop(kept)[1])

    def clear(self) -> None:
        """The index dropped every hold (a reset)."""
        self._kept.clear()
        self._ranges.clear()
        self._last.clear()
        self._count = 0
