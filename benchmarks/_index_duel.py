"""The policy study's comparison: kvoffload's index against vLLM's ``CPUOffloadingManager``.

Both managers are driven by the same per-request loop (lookup, load of the
hit prefix, touch, store of the rest), vLLM's with its per-key ``lookup`` and
its ``on_new_request`` / ``on_request_finished`` hooks around each request,
so hit ratios must agree for LRU and keys per second compare like for like.
Trace keys are packed once, before any timing, for both sides. This is
``benchmarks/replay_vs_vllm.py --index-only``; without it the script compares
the connectors themselves.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.manager import OffloadIndex
from kvoffload.registry import DEFAULT_POLICY
from kvoffload.replay import belady_hits, drive
from kvoffload.replay.trace import Trace

#: (kvoffload policy, vLLM policy it is compared with).
PAIRS = (("lru", "lru"), ("arc", "arc"), (DEFAULT_POLICY, "lru"))


def vllm_driver(requests: Sequence[Sequence[bytes]]) -> Callable[[int, str], int] | None:
    """A function replaying ``requests`` through a fresh vLLM manager, or None without vLLM."""
    try:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError as exc:
        print(f"vLLM not importable ({exc}); reporting kvoffload only", file=sys.stderr)
        return None
    hit = LookupResult.HIT
    # vLLM keys carry a 4-byte group index; build them once, outside the timing.
    keyed = [tuple(make_offload_key(k, 0) for k in keys) for keys in requests]

    def run(capacity: int, policy: str) -> int:
        manager: Any = CPUOffloadingManager(num_chunks=capacity, cache_policy=policy)
        lookup, touch = manager.lookup, manager.touch
        hits = 0
        for i, keys in enumerate(keyed):
            ctx = ReqContext(req_id=str(i))
            manager.on_new_request(ctx)
            n = 0
            for key in keys:
                if lookup(key, ctx) is not hit:
                    break
                n += 1
            if n:
                manager.prepare_load(keys[:n], ctx)
                manager.complete_load(keys[:n], ctx)
                hits += n
            touch(keys, ctx)
            out = manager.prepare_store(keys[n:], ctx)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx, success=True)
            manager.on_request_finished(ctx)
        return hits

    return run


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    """(result, wall time) of one run, garbage collected before and paused during it.

    Both managers allocate per request; a collection landing in one run and
    not the other is noise, not a difference between them.
    """
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start
    finally:
        gc.enable()


def duel(
    repeat: int, ours: Callable[[], int], theirs: Callable[[], int] | None
) -> tuple[tuple[int, float], tuple[int, float] | None]:
    """Best time of ``repeat`` alternating runs of each side (the machine is shared,
    so alternating exposes both to the same load); results must not vary."""
    runs: list[list[tuple[int, float]]] = [[], []]
    for _ in range(repeat):
        runs[0].append(timed(ours))
        if theirs is not None:
            runs[1].append(timed(theirs))
    best: list[tuple[int, float] | None] = []
    for side in runs:
        if not side:
            best.append(None)
            continue
        results = {hits for hits, _ in side}
        if len(results) != 1:
            raise RuntimeError(f"replay is not deterministic: {sorted(results)}")
        best.append((results.pop(), min(secs for _, secs in side)))
    assert best[0] is not None
    return best[0], best[1]


def measure(trace: Trace, capacities: Sequence[int], repeat: int) -> list[dict[str, Any]]:
    """One row per (capacity, kvoffload policy) with the vLLM counterpart and the bound."""
    blocks, requests = trace.num_blocks, trace.requests
    vllm = vllm_driver(requests)
    rows = []
    for capacity in capacities:
        bound = belady_hits(requests, capacity) / blocks
        for ours, theirs in PAIRS:
            (hits, secs), other = duel(
                repeat,
                lambda c=capacity, p=ours: drive(OffloadIndex(c, p, record_events=False), requests),
                None if vllm is None else (lambda c=capacity, p=theirs: vllm(c, p)),
            )
            row: dict[str, Any] = {
                "capacity": capacity,
                "policy": ours,
                "hit_ratio": hits / blocks,
                "keys_per_s": blocks / secs,
                "bound": bound,
            }
            if other is not None:
                v_hits, v_secs = other
                row.update(
                    vllm_policy=theirs,
                    vllm_hit_ratio=v_hits / blocks,
                    vllm_keys_per_s=blocks / v_secs,
                    hit_ratio_x=hits / v_hits if v_hits else float("inf"),
                    speed_x=v_secs / secs,
                )
            rows.append(row)
    return rows


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'capacity':>8} {'policy':<9} {'hit':>7} {'keys/s':>10} | {'vLLM':<4} {'hit':>7} "
        f"{'keys/s':>9} | {'hit x':>6} {'speed x':>7} | {'Belady':>6}"
    )
    for r in rows:
        theirs = (
            f"{r['vllm_policy']:<4} {r['vllm_hit_ratio']:>7.4f} {r['vllm_keys_per_s']:>9,.0f} | "
            f"{r['hit_ratio_x']:>6.2f} {r['speed_x']:>7.2f}"
            if "vllm_policy" in r
            else f"{'-':<4} {'-':>7} {'-':>9} | {'-':>6} {'-':>7}"
        )
        print(
            f"{r['capacity']:>8} {r['policy']:<9} {r['hit_ratio']:>7.4f} "
            f"{r['keys_per_s']:>10,.0f} | {theirs} | {r['bound']:>6.4f}"
        )
