"""The arrival replay: requests come at the trace's own times and wait in the engine's queue.

The engine replay (:mod:`kvoffload.replay.engine`) feeds requests as fast as the
engine takes them, so no request ever waits and nothing is known ahead. Here the
trace is *open loop*: request ``i`` joins the stand-in's waiting queue at its
``timestamp``, and the connector hears of it then (vLLM's ``on_new_request``), so
what queued requests will hit can be kept for them (``queued_cpu_share``) and a
client's retention hint (:mod:`kvoffload.replay.foresight`) arrives with it, as
they do in an engine.

**The service model.** The engine computes prompt tokens at a fixed rate: a step
lasts its tokens over the rate (at least :data:`MIN_STEP_S`), and the clock jumps
over idle time to the next arrival. The rate is set so that the trace *offers*
``load`` of it: ``rate = prompt tokens / (load x the trace's span)``. Hits skip
their tokens, so the engine runs below ``load``; how far is the replay's
``busy`` share. Decode is not modelled (a request leaves when its prompt is
computed): a request waits for the prefill ahead of it only. On the Mooncake
conversation trace at a load of 0.9 the rate is about 45,000 tokens a second,
what one 8-GPU prefill server gives for a mid-sized model.

The connector's clock is the replay's: holds of queued requests (a minute at
most) and kept ranges of hints last in trace seconds.

**The measure** is the share of prompt tokens some cache served, the engine's own
GPU cache or the connector's tiers, held against Belady's MIN over both at once
(``capacity + gpu_blocks`` chunks, and a request's last token always computed):
an offline bound no online placement of the same memory can beat.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvoffload.config import build_offloading_config
from kvoffload.config.layout import KVLayout
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.replay.belady import belady_hits
from kvoffload.replay.engine import EngineSettings, trace_layout
from kvoffload.replay.foresight import Params
from kvoffload.replay.trace import Trace
from kvoffload.standin import KVOffloadSide, StandIn
from kvoffload.transfer import allocate_kv_caches

__all__ = [
    "MIN_STEP_S",
    "ArrivalRow",
    "QueueFigures",
    "SimClock",
    "arrival_bound",
    "replay_arrivals",
    "service_rate",
]

#: The shortest step (a step that only waits for a load still takes the engine's time).
MIN_STEP_S = 0.001


class SimClock:
    """The replay's seconds, read by the connector as it would read ``time.monotonic``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True, slots=True)
class QueueFigures:
    """How long the waiting queue was, and how long requests waited in it."""

    #: Requests waiting (queued or loading), averaged over time; its 99th percentile over
    #: time; the most at once.
    mean: float
    p99: int
    most: int
    #: Seconds from arrival to first scheduled: mean and 99th percentile over requests.
    wait_mean_s: float
    wait_p99_s: float
    #: Share of the trace's span the engine computed (the rest it was idle).
    busy: float


@dataclass(frozen=True, slots=True)
class ArrivalRow:
    """One arrival replay of one trace through one policy at one capacity."""

    trace: str
    policy: str
    capacity: int
    gpu_blocks: int
    hints: str
    load: float
    rate_tokens_per_s: float
    requests: int
    prompt_tokens: int
    gpu_hit_tokens: int
    loaded_tokens: int
    #: Belady's share of prompt tokens at ``capacity + gpu_blocks`` chunks.
    bound: float
    queue: QueueFigures
    #: The connector's counters of holds and hints (``stats()["scheduler"]``).
    counters: dict[str, int]
    scheduler_seconds: float
    seconds: float

    @property
    def hit_ratio(self) -> float:
        """Prompt tokens the GPU cache or the connector served, over all prompt tokens."""
        served = self.gpu_hit_tokens + self.loaded_tokens
        return served / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def of_bound(self) -> float:
        return self.hit_ratio / self.bound if self.bound else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "hit_ratio": self.hit_ratio, "of_bound": self.of_bound}


def service_rate(trace: Trace, load: float) -> float:
    """Prompt tokens a second that ``trace`` offers ``load`` of (see the module docstring)."""
    if not trace.arrivals:
        raise ConfigError(
            f"trace {trace.name!r} has no 'timestamp' on every request: the arrival replay "
            "sends each request at its own time"
        )
    span = trace.arrivals[-1] - trace.arrivals[0]
    if span <= 0:
        raise ConfigError(
            f"trace {trace.name!r}: every request arrives at once, so no rate offers it a "
            "load; give a trace whose timestamps spread, or replay it without --arrivals"
        )
    return sum(_lengths(trace)) / (load * span)


def arrival_bound(trace: Trace, chunks: int) -> float:
    """Belady's share of ``trace``'s prompt tokens with ``chunks`` chunks, in the engine's
    terms: whole blocks stored, the block of a prompt's last token never hit."""
    size, lengths = trace.block_tokens, _lengths(trace)
    stored = [keys[: n // size] for keys, n in zip(trace.requests, lengths, strict=True)]
    usable = [(n - 1) // size for n in lengths]
    return belady_hits(stored, chunks, usable) * size / sum(lengths)


def replay_arrivals(
    trace: Trace,
    capacity: int,
    policy: str,
    *,
    load: float = 0.9,
    hints: tuple[str, Sequence[Params | None]] = ("none", ()),
    settings: EngineSettings | None = None,
    bound: float | None = None,
    queued_cpu_share: float | None = None,
    progress: bool = False,
) -> ArrivalRow:
    """Replay ``trace`` open loop through kvoffload's connector with ``capacity`` CPU chunks.

    ``hints``: a label and each request's ``kv_transfer_params`` (empty: none).
    ``bound``: Belady's share if already computed (:func:`arrival_bound`).
    ``queued_cpu_share``: the connector's key (``None``: its default). ``settings``: the
    engine around it (``None``: :class:`EngineSettings`' defaults).
    """
    settings = EngineSettings() if settings is None else settings
    rate = service_rate(trace, load)
    layout = trace_layout(trace.block_tokens)
    clock = SimClock()
    side = _connector(
        layout,
        capacity,
        policy,
        settings.gpu_blocks,
        queued_cpu_share=queued_cpu_share,
        clock=clock,
    )
    engine = StandIn(layout, side, gpu_blocks=settings.gpu_blocks, step_tokens=settings.step_tokens)
    try:
        queue = _serve(trace, engine, clock, rate, hints[1], progress=progress)
    finally:
        side.close()
    counters = side.scheduler.stats()
    stats = engine.stats
    return ArrivalRow(
        trace.name,
        policy,
        capacity,
        settings.gpu_blocks,
        hints[0],
        load,
        rate,
        stats.requests,
        stats.prompt_tokens,
        stats.gpu_hit_tokens,
        stats.loaded_tokens,
        arrival_bound(trace, capacity + settings.gpu_blocks) if bound is None else bound,
        queue,
        {k: v for k, v in counters.items() if isinstance(v, int) and k in _COUNTERS},
        stats.scheduler_seconds,
        stats.seconds,
    )


def _connector(
    layout: KVLayout,
    capacity: int,
    policy: str,
    gpu_blocks: int,
    *,
    queued_cpu_share: float | None,
    clock: SimClock,
) -> KVOffloadSide:
    """kvoffload's scheduler side on the replay's clock, its orders done at once (decisions
    only: no bytes move, as in the engine replay's scheduler timing)."""
    keys: dict[str, object] = {
        "cpu_bytes_to_use": capacity * layout.groups[0].chunk_bytes(1),
        "eviction_policy": policy,
    }
    if queued_cpu_share is not None:
        keys["queued_cpu_share"] = queued_cpu_share
    config = build_offloading_config(keys, layout)
    kv = allocate_kv_caches(layout, gpu_blocks, torch.uint8)
    namespace = namespace_of("kvoffload-replay", "uint8", layout)
    return KVOffloadSide(config, namespace, kv, record_events=False, transfers=False, clock=clock)


#: The connector's counters a row keeps: what holds and hints did.
_COUNTERS = (
    "queued_holds",
    "queued_held_chunks",
    "queued_hold_expiries",
    "index_spilled",
    "retention_hints",
    "retention_hints_ignored",
    "retention_kept_chunks",
    "retention_dropped_chunks",
)


def _serve(
    trace: Trace,
    engine: StandIn,
    clock: SimClock,
    rate: float,
    hints: Sequence[Params | None],
    *,
    progress: bool,
) -> QueueFigures:
    """Feed ``engine`` each request at its arrival, step it on ``clock``; the queue's figures."""
    arrivals, n = trace.arrivals, len(trace.requests)
    origin = arrivals[0]
    arrived: dict[str, float] = {}
    waits: list[float] = []
    samples: list[tuple[int, float]] = []  # (requests waiting, seconds), per step
    busy, i = 0.0, 0
    bar = _progress(n, trace.name) if progress else None
    while True:
        while i < n and arrivals[i] - origin <= clock.now:
            params = hints[i] if hints else None
            engine.add(str(i), trace.tokens(i).tolist(), kv_transfer_params=params)
            arrived[str(i)] = arrivals[i] - origin
            i += 1
            if bar is not None:
                bar.update()
        if not (engine.waiting or engine.running):
            if i == n:
                break
            clock.now = arrivals[i] - origin  # idle until the next arrival
            continue
        plan = engine.step()
        waits += [clock.now - arrived.pop(req_id) for req_id in plan.first]
        seconds = max(plan.num_tokens / rate, MIN_STEP_S)
        busy += plan.num_tokens / rate
        samples.append((len(engine.waiting), seconds))
        clock.now += seconds
    engine.step()  # the last finished requests are told one step later, as in vLLM
    if bar is not None:
        bar.close()
    span = max(clock.now, arrivals[-1] - origin)
    return _figures(samples, waits, busy / span if span else 0.0)


def _figures(samples: list[tuple[int, float]], waits: list[float], busy: float) -> QueueFigures:
    total = sum(seconds for _, seconds in samples)
    mean = sum(k * seconds for k, seconds in samples) / total if total else 0.0
    by_length = sorted(samples)
    cumulative, p99 = 0.0, 0
    for k, seconds in by_length:
        cumulative += seconds
        p99 = k
        if cumulative >= 0.99 * total:
            break
    waits.sort()
    return QueueFigures(
        mean=mean,
        p99=p99,
        most=max((k for k, _ in samples), default=0),
        wait_mean_s=sum(waits) / len(waits) if waits else 0.0,
        wait_p99_s=waits[int(0.99 * (len(waits) - 1))] if waits else 0.0,
        busy=busy,
    )


def _lengths(trace: Trace) -> Sequence[int]:
    if trace.lengths:
        return trace.lengths
    return [len(keys) * trace.block_tokens for keys in trace.requests]


def _progress(total: int, name: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="req", file=sys.stderr, leave=False)
