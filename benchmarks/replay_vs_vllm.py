"""kvoffload's connector against vLLM's own ``OffloadingConnector``, one engine, one process.

Both connectors serve the same trace in the same stand-in engine
(:mod:`kvoffload.standin`: vLLM 0.32's step order, a GPU prefix cache of
``--gpu-blocks`` blocks with vLLM's eviction order), one after the other in
this process: kvoffload through its real ``OffloadScheduler`` and
``OffloadWorker`` (a CPU tier moving real, tiny pages), vLLM through its real
``OffloadingConnector`` scheduler side with ``CPUOffloadingSpec`` (its worker
refuses the CPU platform, so its transfers complete at once). Per capacity
and policy pair it reports the connector's hit ratio (prompt tokens loaded
from the CPU tier over all prompt tokens) and the milliseconds per engine
step spent in the connector's scheduler-side calls, side by side.

kvoffload's scheduler is timed twice: with its transfers completing at once,
as vLLM's do (no worker runs between its calls: the like-for-like figure the
speed ratio is taken from), and with its real worker moving bytes between
its calls, which leaves the caches colder for the next one (the second
figure). Both runs must find the same hits.

Run it in the vLLM environment (``make vllm-setup``)::

    .venv-vllm/bin/python benchmarks/replay_vs_vllm.py \\
        ../shared/traces/mooncake_conversation_trace.jsonl --capacities 4000,16000,64000

Each timing is the best of ``--repeat`` runs, the two connectors alternating
(the machine may be shared; the fastest run is the least disturbed one); hit
ratios must not vary between runs. ``--index-only`` compares the offload
indexes alone instead (kvoffload's ``OffloadIndex`` against vLLM's
``CPUOffloadingManager``, the policy study of ``kvoffload replay --index-only``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvoffload.cli.replay import parse_capacities
from kvoffload.replay import load_trace
from kvoffload.replay.engine import (
    EngineRow,
    EngineSettings,
    replay_engine,
    run_side,
    trace_layout,
)
from kvoffload.replay.trace import Trace

DEFAULT_TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"
#: kvoffload policy:vLLM policy pairs compared by default.
DEFAULT_PAIRS = "adaptive:lru,lru:lru"


def kvoffload_row(
    trace: Trace,
    capacity: int,
    policy: str,
    settings: EngineSettings,
    *,
    key_source: str = "auto",
    transfers: bool = True,
    queued_cpu_share: float | None = None,
) -> EngineRow:
    """One replay through kvoffload's connector (``key_source``, ``queued_cpu_share``: the
    connector's keys; ``transfers=False``: its orders complete at once, as vLLM's do here).
    Its hits load a step later (``load_in_step: never``), as vLLM's connector's do, so that
    the two differ only in their index, policy and hit rules, and the steps line up."""
    return replay_engine(trace, capacity, policy, settings=settings, key_source=key_source,
                         transfers=transfers, load_in_step="never",
                         queued_cpu_share=queued_cpu_share)  # fmt: skip


def vllm_row(trace: Trace, capacity: int, policy: str, settings: EngineSettings) -> EngineRow:
    """One replay through vLLM's connector in the same stand-in engine."""
    from _vllm_side import VLLMSide

    layout = trace_layout()
    side = VLLMSide(layout, capacity, policy, settings.gpu_blocks)
    stats = run_side(trace, side, layout, settings)
    return EngineRow.of(trace, "vllm", policy, (capacity, settings.gpu_blocks), stats)


def best(runs: Sequence[EngineRow]) -> EngineRow:
    """The run with the least scheduler time; every run must have hit alike."""
    hits = {(r.gpu_hit_tokens, r.loaded_tokens) for r in runs}
    if len(hits) != 1:
        raise RuntimeError(f"{runs[0].connector} replay is not deterministic: {sorted(hits)}")
    return min(runs, key=lambda r: r.scheduler_seconds)


def timed(
    run: Callable[[Trace, int, str, EngineSettings], EngineRow],
    trace: Trace,
    capacity: int,
    policy: str,
    settings: EngineSettings,
) -> EngineRow:
    """One run with garbage collected before it (a collection is noise, not a difference)."""
    gc.collect()
    return run(trace, capacity, policy, settings)


def compare(
    trace: Trace,
    capacities: Sequence[int],
    pairs: Sequence[tuple[str, str]],
    settings: EngineSettings,
    repeat: int,
    *,
    key_source: str = "auto",
) -> list[dict[str, Any]]:
    """Rows of ``pairs`` per capacity; each distinct run is made ``repeat`` times, alternating."""
    ours_row = functools.partial(kvoffload_row, key_source=key_source)
    at_once = functools.partial(kvoffload_row, key_source=key_source, transfers=False)
    sides = (("kvoffload", ours_row), ("kvoffload at once", at_once), ("vllm", vllm_row))
    rows = []
    for capacity in capacities:
        runs: dict[tuple[str, str], list[EngineRow]] = {}
        for attempt in range(repeat):
            for pair in pairs:
                for (side, run), policy in zip(sides, (pair[0], pair[0], pair[1]), strict=True):
                    key = (side, policy)
                    if len(runs.setdefault(key, [])) <= attempt:
                        runs[key].append(timed(run, trace, capacity, policy, settings))
                        print(f"done: {side} {policy} at {capacity}", file=sys.stderr, flush=True)
        for ours, theirs in pairs:
            a, b = best(runs[("kvoffload", ours)]), best(runs[("vllm", theirs)])
            quick = best(runs[("kvoffload at once", ours)])
            if (quick.gpu_hit_tokens, quick.loaded_tokens) != (a.gpu_hit_tokens, a.loaded_tokens):
                raise RuntimeError(f"{ours} at {capacity}: transfers at once changed the hits")
            rows.append({
                "capacity": capacity, "gpu_blocks": settings.gpu_blocks, "steps": a.steps,
                "policy": ours, "hit_ratio": a.hit_ratio, "gpu_hit_ratio": a.gpu_hit_ratio,
                "ms_per_step": quick.scheduler_ms_per_step,
                "ms_per_step_with_worker": a.scheduler_ms_per_step, "vllm_policy": theirs,
                "vllm_hit_ratio": b.hit_ratio, "vllm_gpu_hit_ratio": b.gpu_hit_ratio,
                "vllm_steps": b.steps, "vllm_ms_per_step": b.scheduler_ms_per_step,
                "hit_x": a.hit_ratio / b.hit_ratio if b.hit_ratio else None,
                "speed_x": b.scheduler_ms_per_step / quick.scheduler_ms_per_step,
            })  # fmt: skip
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| CPU chunks | kvoffload policy | hit ratio | sched ms/step | with its worker "
        "| vLLM policy | hit ratio | sched ms/step | hit x | speed x | GPU hit ratio |",
        "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['capacity']} | {r['policy']} | {r['hit_ratio']:.4f} | {r['ms_per_step']:.3f} "
            f"| {r['ms_per_step_with_worker']:.3f} "
            f"| {r['vllm_policy']} | {r['vllm_hit_ratio']:.4f} | {r['vllm_ms_per_step']:.3f} "
            f"| {'-' if r['hit_x'] is None else format(r['hit_x'], '.2f')} | {r['speed_x']:.2f} "
            f"| {r['gpu_hit_ratio']:.4f} |"
        )
    return "\n".join(lines)


def index_only(trace: Trace, capacities: Sequence[int], repeat: int, as_json: bool) -> None:
    from _index_duel import measure, print_table

    rows = measure(trace, capacities, repeat)
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{trace.name}: {len(trace.requests):,} requests, {trace.num_blocks:,} blocks")
        print_table(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    parser.add_argument("--capacities", default="4000,16000,64000", help="CPU chunks")
    parser.add_argument("--gpu-blocks", type=int, default=EngineSettings().gpu_blocks)
    parser.add_argument("--step-tokens", type=int, default=EngineSettings().step_tokens)
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help="kvoffload:vllm policy pairs")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--repeat", type=int, default=1, help="runs per figure, best kept")
    parser.add_argument("--key-source", default="auto", choices=("auto", "tokens", "engine"),
                        help="kvoffload's key_source (auto: the engine's block hashes, as "
                             "with vLLM's default hash)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    parser.add_argument("--index-only", action="store_true", help="compare the indexes only")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace, limit=args.limit)
    capacities = parse_capacities(args.capacities)
    repeat = max(1, args.repeat)
    if args.index_only:
        index_only(trace, capacities, repeat, args.json)
        return 0
    settings = EngineSettings(gpu_blocks=args.gpu_blocks, step_tokens=args.step_tokens)
    pairs = [tuple(p.split(":", 1)) for p in args.pairs.split(",")]
    start = time.perf_counter()
    rows = compare(trace, capacities, pairs, settings, repeat, key_source=args.key_source)  # type: ignore[arg-type]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"{trace.name}: {len(trace.requests):,} requests, GPU cache {settings.gpu_blocks} blocks "
        f"of {trace_layout().groups[0].tokens_per_block} tokens, {settings.step_tokens} tokens "
        f"per step, best of {repeat}, key_source={args.key_source}, "
        f"{time.perf_counter() - start:.0f} s"
    )
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
