"""Fault points: the worker side damages loads and stores on purpose, when told to.

A check that never failed proves little: "the same tokens as vLLM's own prefix
cache" passes just as well if a wrong block barely moves a tiny model. Each
end-to-end exactness test therefore has a negative control, the same run with
a fault point on, which must fail it. The points are named in the environment
variable ``KVOFFLOAD_FAILPOINTS`` (comma-separated), read once, when an
:class:`~kvoffload.engine.OffloadEngine` starts; without it the engine holds
``None`` and each hook costs one attribute test. When on, the engine logs one
WARNING naming them. docs/failpoints.md describes them for users.

Every point but ``load.fail_last_chunk`` is silent: the job reports success,
the counters agree, and only the bytes in the engine's blocks (or in the
tiers) are wrong. That is what a
bug would do; the checksum path, which reports a failed load, is not faked.

``load.corrupt_block``
    The last block a load fills in a group gets its own bytes with every byte
    XOR 0x80 (bfloat16, float16 and float32 values change sign and halve or
    double; nothing becomes infinite).
``load.wrong_block``
    That last block gets another block's bytes: the one at the same position
    of the first chunk the load fills in that group (plausible KV, from the
    wrong place). Needs two chunks in the group's span; with one it does
    nothing and does not count as fired.
``load.skip_last_chunk``
    The last chunk of the group's span is not copied into the engine at all;
    its blocks keep whatever they held.
``load.fail_last_chunk``
    The last chunk of the group's span is not copied and the load reports it
    failed, as when a tier lost it or its copy raised. The one point that is
    not silent: it proves the failure path (vLLM recomputes the blocks),
    where the others prove that the checks would see a wrong block.
``store.drop``
    A store copies nothing out of the engine: the chunk's CPU slot, and what
    the tiers below are written from it, keep older bytes.
``store.slow_lower=DURATION``
    Not damage but delay: a store job waits ``DURATION`` (``3s``, ``250ms``)
    between copying its chunks out of the engine and writing them to the CPU
    slots and the lower tiers, as a slow disk or a far server would (its chance
    is the job, not a span). The step goes on meanwhile. It proves that a
    consumer engine sent a request while a producer's stores are still on their
    way waits for them (:mod:`kvoffload.connector.handoffs`).
``load.slow_lower=RATE``
    Not damage but delay: every chunk a job reads from a lower tier (disk or
    remote: a load, a load in the step, a promotion or a fetch while queued)
    takes at least its bytes at ``RATE`` (``200MB/s``, ``1.5GiB/s``), the reads
    of one engine sharing that rate as they would share a disk, so a slow
    disk is one setting whatever the model, the group or ``blocks_per_chunk``
    (what a cgroup's read limit on the disk's device would do). A chunk found
    in the CPU tier is never delayed. Its chance is one chunk read from a
    lower tier; it always fires, and counts the chunks it delayed.

A load point's chance is one run of verified chunks of one group in one load
job (one scatter: usually the group's whole span); a store point's is one
group's span of one store job. ``name`` alone fires on every chance;
``name=N`` (an integer) on the first ``N``; ``name=R`` (a decimal, ``0 < R <= 1``)
on each with probability ``R``, drawn from a fixed seed so a run repeats.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from kvoffload.config.values import Bounds, to_size
from kvoffload.errors import ConfigError
from kvoffload.messages import BlockSpan

__all__ = ["ENV", "POINTS", "FailPoints"]

logger = logging.getLogger("kvoffload")

ENV = "KVOFFLOAD_FAILPOINTS"
POINTS = (
    "load.corrupt_block",
    "load.wrong_block",
    "load.skip_last_chunk",
    "load.fail_last_chunk",
    "store.drop",
    "store.slow_lower",
    "load.slow_lower",
)
#: Points whose value is a duration, not a count or a rate.
_DELAYS = ("store.slow_lower",)
#: Points whose value is a read rate (bytes a second).
_RATES = ("load.slow_lower",)
#: A scatter as :meth:`kvoffload.transfer.KVTransfer.scatter` does it (the CUDA event bound).
Scatter = Callable[[int, BlockSpan, Sequence[torch.Tensor]], None]


def _parse_value(point: str, text: str) -> tuple[int | None, float]:
    """``(count, rate)`` of ``point=text``; ``count`` None means no limit."""
    try:
        if "." in text:
            rate = float(text)
            if 0 < rate <= 1:
                return None, rate
        elif int(text) > 0:
            return int(text), 1.0
    except ValueError:
        pass
    raise ConfigError(
        f"{ENV}: {point}={text!r} is not a count (an integer > 0) or a rate "
        f"(a decimal in (0, 1]); write {point}, {point}=3 or {point}=0.5"
    )


def _parse_duration(point: str, text: str) -> float:
    """Seconds of ``point=text``, where ``text`` is ``3s`` or ``250ms``."""
    number, unit = (text[:-2], 1e-3) if text.endswith("ms") else (text[:-1], 1.0)
    try:
        if text.endswith("s") and float(number) > 0:
            return float(number) * unit
    except ValueError:
        pass
    raise ConfigError(
        f"{ENV}: {point}={text!r} is not a duration; write {point}=3s or {point}=250ms"
    )


def _parse_rate(point: str, text: str) -> float:
    """Bytes a second of ``point=text``, where ``text`` is a size a second (``200MB/s``)."""
    size = text.removesuffix("/s")
    try:
        if size != text and size.strip():
            return float(to_size(point, size, Bounds(1, 2**60)))
    except ConfigError:
        pass
    raise ConfigError(
        f"{ENV}: {point}={text!r} is not a read rate; write {point}=200MB/s or "
        f"{point}=1.5GiB/s (a size a second, at least 1B/s)"
    )


class FailPoints:
    """The points turned on, and how often each has fired (thread-safe: jobs run on a pool)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._limits: dict[str, tuple[int | None, float]] = {}
        self._delays: dict[str, float] = {}
        self._rates: dict[str, float] = {}
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            name, _, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if name not in POINTS:
                raise ConfigError(
                    f"{ENV}: unknown fault point {name!r}; the points are {', '.join(POINTS)}"
                )
            if name in _DELAYS:
                self._delays[name] = _parse_duration(name, value)
                self._limits[name] = (None, 1.0)
            elif name in _RATES:
                self._rates[name] = _parse_rate(name, value)
                self._limits[name] = (None, 1.0)
            else:
                self._limits[name] = _parse_value(name, value) if value else (None, 1.0)
        self.fired = Counter[str]()
        self._random = random.Random(0)
        self._lock = threading.Lock()
        #: When the slow lower tier has read every chunk asked of it so far (perf_counter).
        self._reads_done = 0.0

    @classmethod
    def from_env(cls) -> FailPoints | None:
        """The points ``KVOFFLOAD_FAILPOINTS`` names, logged loudly; ``None`` when none are."""
        spec = os.environ.get(ENV, "")
        if not spec.strip():
            return None
        points = cls(spec)
        logger.warning(
            "kvoffload: fault points ON (%s=%s): loads and stores are DAMAGED ON PURPOSE; "
            "for negative controls only, never in service",
            ENV,
            spec,
        )
        return points

    def fires(self, point: str) -> bool:
        """Whether ``point`` fires at this chance (counted in :attr:`fired` when it does)."""
        if point not in self._limits:
            return False
        count, rate = self._limits[point]
        with self._lock:
            if count is not None and self.fired[point] >= count:
                return False
            if rate < 1 and self._random.random() >= rate:
                return False
            self.fired[point] += 1
        return True

    def stats(self) -> dict[str, int]:
        """How often each point turned on fired: flat counters (``failpoint_load_wrong_block``)."""
        return {f"failpoint_{name.replace('.', '_')}": self.fired[name] for name in self._limits}

    def scatter(
        self,
        scatter: Scatter,
        bpc: int,
        group: int,
        span: BlockSpan,
        chunks: Sequence[torch.Tensor],
    ) -> None:
        """``scatter(group, span, chunks)`` with the load points that fire applied."""
        ranges = span.chunk_ranges(bpc)
        if self.fires("load.skip_last_chunk"):
            keep = ranges[-1][0]  # the blocks before the last chunk's
            if keep == 0:
                return
            span, chunks = BlockSpan(span.block_ids[:keep], span.first_offset), chunks[:-1]
            ranges = ranges[:-1]
        scatter(group, span, chunks)
        start, stop, position = ranges[-1]
        last = BlockSpan((span.block_ids[-1],), position + stop - start - 1)
        if len(chunks) > 1 and self.fires("load.wrong_block"):
            scatter(group, last, [chunks[0]])
        if self.fires("load.corrupt_block"):
            scatter(group, last, [torch.bitwise_xor(chunks[-1], 0x80)])

    def fails_load(self) -> bool:
        """Whether this load span reports its last chunk failed (``load.fail_last_chunk``)."""
        return self.fires("load.fail_last_chunk")

    def drops_store(self) -> bool:
        """Whether this store span copies nothing out of the engine (``store.drop``)."""
        return self.fires("store.drop")

    def slow_lower(self) -> None:
        """Wait before this store span writes the lower tiers (``store.slow_lower``)."""
        if self.fires("store.slow_lower"):
            time.sleep(self._delays["store.slow_lower"])

    def slow_read(self, nbytes: int, started: float) -> None:
        """A chunk of ``nbytes`` read from a lower tier since ``started`` (``perf_counter``):
        wait until ``load.slow_lower``'s rate would have read it, after the chunks before it.

        The time the read itself took counts towards it, and the reads of every job share
        the rate, so two at once take twice as long as one.
        """
        if not self.fires("load.slow_lower"):
            return
        seconds = nbytes / self._rates["load.slow_lower"]
        with self._lock:
            done = self._reads_done = max(started, self._reads_done) + seconds
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
