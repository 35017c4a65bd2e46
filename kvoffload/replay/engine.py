"""The engine replay: a trace through the connector's scheduler and worker, the stand-in as vLLM.

Each request of the trace becomes token ids (:meth:`Trace.tokens`), enters a
:class:`~kvoffload.standin.StandIn` engine with a GPU prefix cache of
``gpu_blocks`` blocks, and is served by the connector's real
:class:`~kvoffload.connector.scheduler.OffloadScheduler` and
:class:`~kvoffload.connector.worker.OffloadWorker` over a real CPU tier: every
hit rule, every store, every load the product makes, with real bytes. The
pages are tiny (one layer, one byte per token for K and for V), so bytes are
cheap and the figures measure decisions, not copies.

The hit ratio is the connector's: prompt tokens loaded from the offload
tiers over all prompt tokens. What the GPU cache served is reported beside
it; a token counts once, for whoever served it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from kvoffload.config import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.keys import namespace_of
from kvoffload.replay.trace import TRACE_BLOCK_TOKENS, Trace
from kvoffload.standin import ConnectorSide, KVOffloadSide, StandIn, StandInStats
from kvoffload.transfer import allocate_kv_caches

__all__ = [
    "EngineRow",
    "EngineSettings",
    "engine_requests",
    "format_engine_table",
    "replay_engine",
    "run_side",
    "tiny_pages",
    "trace_layout",
]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The simulated engine around the connector."""

    #: Blocks of the GPU prefix cache (every group draws from them).
    gpu_blocks: int = 1000
    #: Tokens one step may compute (vLLM's ``max_num_batched_tokens``).
    step_tokens: int = 8192
    #: Requests in the engine at once (waiting, loading or running).
    in_flight: int = 4


def trace_layout(tokens_per_block: int = TRACE_BLOCK_TOKENS) -> KVLayout:
    """One full-attention group whose block is a trace block: one GPU block, one chunk."""
    return tiny_pages(KVLayout((CacheGroup("full", tokens_per_block, ("layer",), 1),)))


def tiny_pages(layout: KVLayout) -> KVLayout:
    """``layout`` with one layer per group and pages of one byte per token for K and for V.

    Group kinds, block sizes and windows, which decide every hit, stay; the
    bytes a replay moves shrink to almost nothing.
    """
    return KVLayout(
        tuple(
            replace(g, layer_names=g.layer_names[:1], page_bytes=2 * g.tokens_per_block)
            for g in layout.groups
        )
    )


@dataclass(frozen=True, slots=True)
class EngineRow:
    """One replay of one trace through one connector at one CPU capacity."""

    trace: str
    connector: str
    policy: str
    capacity: int
    gpu_blocks: int
    requests: int
    steps: int
    prompt_tokens: int
    gpu_hit_tokens: int
    loaded_tokens: int
    failed_load_tokens: int
    scheduler_seconds: float
    seconds: float
    #: Prompt tokens the connector's lookups left unserved, by reason (kvoffload's only).
    miss_tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        trace: Trace,
        connector: str,
        policy: str,
        settings: tuple[int, int],
        stats: StandInStats,
        *,
        miss_tokens: dict[str, int] | None = None,
    ) -> EngineRow:
        """A row from a run's stats; ``settings`` are ``(capacity, gpu_blocks)``."""
        capacity, gpu_blocks = settings
        return cls(
            trace.name,
            connector,
            policy,
            capacity,
            gpu_blocks,
            stats.requests,
            stats.steps,
            stats.prompt_tokens,
            stats.gpu_hit_tokens,
            stats.loaded_tokens,
            stats.failed_load_tokens,
            stats.scheduler_seconds,
            stats.seconds,
            dict(miss_tokens or {}),
        )

    @property
    def hit_ratio(self) -> float:
        """Prompt tokens loaded from the offload tiers, over all prompt tokens."""
        return self.loaded_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_hit_ratio(self) -> float:
        """Prompt tokens the GPU prefix cache served, over all prompt tokens."""
        return self.gpu_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def scheduler_ms_per_step(self) -> float:
        """Milliseconds of the connector's scheduler-side calls per engine step."""
        return 1000 * self.scheduler_seconds / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "hit_ratio": self.hit_ratio,
            "gpu_hit_ratio": self.gpu_hit_ratio,
            "scheduler_ms_per_step": self.scheduler_ms_per_step,
        }


def engine_requests(
    trace: Trace, *, progress: bool = False, desc: str = ""
) -> Iterator[tuple[str, Sequence[int]]]:
    """``(request id, token ids)`` for every request of ``trace``, built as the engine asks.

    Token ids are a list, as vLLM hands them to a connector (``all_token_ids``).
    """
    indices: Sequence[int] | Iterator[int] = range(len(trace.requests))
    if progress:
        from tqdm import tqdm

        indices = iter(tqdm(indices, desc=desc, unit="req", file=sys.stderr, leave=False))
    for i in indices:
        yield str(i), trace.tokens(i).tolist()


def replay_engine(
    trace: Trace,
    capacity: int,
    policy: str,
    *,
    layout: KVLayout | None = None,
    settings: EngineSettings = EngineSettings(),
    progress: bool = False,
    key_source: str = "auto",
    transfers: bool = True,
    load_in_step: str = "auto",
    queued_cpu_share: float | None = None,
) -> EngineRow:
    """Replay ``trace`` through kvoffload's connector with ``capacity`` CPU chunks.

    ``key_source``, ``load_in_step`` and ``queued_cpu_share`` are the connector's
    keys of those names: by default, as in vLLM with its default hash, keys come
    from the engine's block hashes, CPU-tier hits load in the step that asks, and
    queued requests hold their chunks (``None``: the key's default).
    ``transfers=False``: orders complete at once and no bytes move (see
    :class:`~kvoffload.standin.KVOffloadSide`); the hits are the same.
    """
    layout = trace_layout() if layout is None else layout
    slot = max(g.chunk_bytes(1) for g in layout.groups)
    keys: dict[str, object] = {
        "cpu_bytes_to_use": capacity * slot,
        "blocks_per_chunk": 1,
        "eviction_policy": policy,
        "key_source": key_source,
        "load_in_step": load_in_step,
    }
    if queued_cpu_share is not None:
        keys["queued_cpu_share"] = queued_cpu_share
    config = build_offloading_config(keys, layout)
    kv = allocate_kv_caches(layout, settings.gpu_blocks, torch.uint8)
    # No KV events, as vLLM runs by default (its own connector then keeps none either).
    namespace = namespace_of("kvoffload-replay", "uint8", layout)
    side = KVOffloadSide(config, namespace, kv, record_events=False, transfers=transfers)
    stats = run_side(trace, side, layout, settings, progress=progress, desc=f"{policy}@{capacity}")
    misses = side.scheduler.stats()["miss_tokens_by_reason"]
    assert isinstance(misses, dict)  # the figure's type, for mypy
    return EngineRow.of(
        trace, "kvoffload", policy, (capacity, settings.gpu_blocks), stats, miss_tokens=misses
    )


def run_side(
    trace: Trace,
    side: ConnectorSide,
    layout: KVLayout,
    settings: EngineSettings,
    *,
    progress: bool = False,
    desc: str = "",
) -> StandInStats:
    """Serve ``trace`` with the stand-in engine around ``side``, then close ``side``.

    The one loop both connectors run in ``benchmarks/replay_vs_vllm.py``.
    """
    engine = StandIn(layout, side, gpu_blocks=settings.gpu_blocks, step_tokens=settings.step_tokens)
    try:
        return engine.run(engine_requests(trace, progress=progress, desc=desc), settings.in_flight)
    finally:
        side.close()


def format_engine_table(rows: Sequence[EngineRow]) -> str:
    """A fixed-width table: the connector's hit ratio (tokens it loaded over prompt tokens),
    the GPU cache's beside it, scheduler ms per step."""
    header = (
        "connector",
        "policy",
        "capacity",
        "gpu blocks",
        "loaded",
        "gpu cache",
        "sched ms/step",
    )
    lines = ["{:<10} {:<9} {:>8} {:>10} {:>7} {:>9} {:>13}".format(*header)]
    for r in rows:
        lines.append(
            f"{r.connector:<10} {r.policy:<9} {r.capacity:>8} {r.gpu_blocks:>10} "
            f"{r.hit_ratio:>7.4f} {r.gpu_hit_ratio:>9.4f} {r.scheduler_ms_per_step:>13.3f}"
        )
    lines.append(
        "loaded: share of prompt tokens the connector loaded; gpu cache: share served by "
        "the engine's own prefix cache"
    )
    lines += [line for r in rows if (line := format_misses(r))]
    return "\n".join(lines)


def format_misses(row: EngineRow) -> str:
    """Why the lookups left prompt tokens unserved, as shares of the prompt tokens."""
    if not row.miss_tokens or not row.prompt_tokens:
        return ""
    shares = sorted(row.miss_tokens.items(), key=lambda item: -item[1])
    text = ", ".join(f"{name} {n / row.prompt_tokens:.1%}" for name, n in shares)
    return f"{row.policy}@{row.capacity} misses (of prompt tokens): {text}"
