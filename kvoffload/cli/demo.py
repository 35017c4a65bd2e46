"""``kvoffload demo``: replay a request trace through every layer, moving and checking real bytes.

On a Gemma-4-like hybrid layout (the bundled ``tiny_gemma4`` config: three
sliding-window groups of 256-token blocks and a full-attention group of
16-token blocks), it builds KV tensors in vLLM's CPU-backend layout, replays
the bundled trace (``examples/demo_trace.jsonl``, shared system prompts and
multi-turn conversations) through the offload index, the engine, the CPU
tier and a disk tier, and checks every loaded block bit-exact. It prints hit
ratios per group and tier, bytes moved and GB/s per tier; the exit code is 1
if any block came back wrong or any store failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from kvoffload.cli._demo_sim import DemoReplay, DemoStats
from kvoffload.cli._demo_trace import TRACE_BLOCK_TOKENS
from kvoffload.config import build_offloading_config
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.config.values import format_bytes
from kvoffload.errors import ConfigError

__all__ = ["register", "run"]

#: Vocabulary the trace's hash ids expand into (any size works; keys hash token ids).
_VOCAB = 1024


def _bundled(name: str) -> Path:
    return Path(str(resources.files("kvoffload") / "examples" / name))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="replay a trace through index, engine, CPU and disk tiers; verify every byte",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N")
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake-format trace (JSONL)")
    parser.add_argument("--disk-path", default=None, help="disk tier directory (default: temp)")
    parser.add_argument("--cpu-bytes", default="16MiB", help="CPU tier budget (default 16MiB)")
    parser.add_argument("--disk-bytes", default="1GiB", help="disk tier budget (default 1GiB)")
    parser.add_argument("--blocks-per-chunk", type=int, default=2, help="default 2")
    parser.add_argument("--seed", type=int, default=0, help="allocator and prefix-cache seed")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=run)


def read_trace(path: Path, limit: int | None) -> list[tuple[list[int], int]]:
    """``(hash_ids, input_length)`` per request; ``ConfigError`` naming the line if malformed."""
    requests: list[tuple[list[int], int]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read trace {str(path)!r}: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            ids, length = record["hash_ids"], record.get("input_length")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path.name}:{number}: not a Mooncake trace record ({exc})") from exc
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise ConfigError(f"{path.name}:{number}: hash_ids must be a non-empty list of ints")
        full = len(ids) * TRACE_BLOCK_TOKENS
        requests.append((ids, length if isinstance(length, int) and 0 < length <= full else full))
    if not requests:
        raise ConfigError(f"trace {str(path)!r} holds no requests")
    return requests


def token_ids(hash_ids: list[int], length: int) -> npt.NDArray[np.int64]:
    """A request's tokens: each hash id expands to its own reproducible 512 tokens."""
    parts = [
        np.random.Generator(np.random.PCG64(h)).integers(0, _VOCAB, TRACE_BLOCK_TOKENS)
        for h in hash_ids
    ]
    return np.concatenate(parts)[:length].astype(np.int64)


def replay(args: argparse.Namespace, disk_path: str) -> DemoStats:
    if args.requests is not None and args.requests <= 0:
        raise ConfigError(f"--requests must be positive, got {args.requests}")
    layout = layout_from_hf_config(_bundled("tiny_gemma4.json"), "bfloat16", 16)
    extra = {
        "cpu_bytes_to_use": args.cpu_bytes,
        "blocks_per_chunk": args.blocks_per_chunk,
        "disk_path": disk_path,
        "disk_bytes_to_use": args.disk_bytes,
    }
    config = build_offloading_config(extra, layout)
    requests = read_trace(args.trace or _bundled("demo_trace.jsonl"), args.requests)
    longest = max(length for _, length in requests)
    num_blocks = -(-longest // min(layout.tokens_per_block)) + 1
    sim = DemoReplay(config, num_blocks, seed=args.seed)
    try:
        bar = tqdm(requests, desc="demo", unit="req", file=sys.stderr, disable=args.no_progress)
        for hash_ids, length in bar:
            sim.serve(token_ids(hash_ids, length))
    finally:
        sim.close()
    return sim.stats


def run(args: argparse.Namespace) -> int:
    if args.disk_path is not None:
        stats = replay(args, args.disk_path)
    else:
        with tempfile.TemporaryDirectory(prefix="kvoffload-demo-") as tmp:
            stats = replay(args, tmp)
    report = to_json(stats)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if stats.ok else 1


def to_json(stats: DemoStats) -> dict[str, Any]:
    groups = []
    for g in stats.groups:
        hits = g.cpu_hits + g.disk_hits
        groups.append({"chunks": g.chunks, "cpu_hits": g.cpu_hits, "disk_hits": g.disk_hits,
                       "hit_ratio": hits / g.chunks if g.chunks else 0.0,
                       "gpu_cached_blocks": g.gpu_cached_blocks,
                       "loaded_blocks": g.loaded_blocks})  # fmt: skip
    chunks = sum(g.chunks for g in stats.groups)
    tiers = {
        name: {"stored_bytes": t.store_bytes, "store_gbps": t.store_gbps,
               "loaded_bytes": t.load_bytes, "load_gbps": t.load_gbps,
               "store_failures": t.store_failures + t.dropped,
               "load_failures": t.load_failures + t.corrupt}
        for name, t in stats.traffic.items()
    }  # fmt: skip
    return {
        "ok": stats.ok,
        "requests": stats.requests,
        "seconds": stats.seconds,
        "hit_ratio": sum(g.cpu_hits + g.disk_hits for g in stats.groups) / chunks if chunks else 0,
        "groups": groups,
        "tiers": tiers,
        "verified_blocks": stats.verified_blocks,
        "mismatched_blocks": stats.mismatched_blocks,
        "failed_load_blocks": stats.failed_load_blocks,
        "failed_stores": stats.failed_stores,
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        f"kvoffload demo: {report['requests']} requests in {report['seconds']:.1f} s, "
        f"chunk hit ratio {report['hit_ratio']:.1%}",
        "",
        "group  chunks  cpu hits  disk hits  hit ratio",
    ]
    for i, g in enumerate(report["groups"]):
        lines.append(f"{i:>5}  {g['chunks']:>6}  {g['cpu_hits']:>8}  {g['disk_hits']:>9}  "
                     f"{g['hit_ratio']:>9.1%}")  # fmt: skip
    lines += ["", "tier  stored       GB/s  loaded       GB/s  failures"]
    for name, t in report["tiers"].items():
        lines.append(
            f"{name:<4}  {format_bytes(t['stored_bytes']):>10}  {t['store_gbps']:>5.2f}  "
            f"{format_bytes(t['loaded_bytes']):>10}  {t['load_gbps']:>5.2f}  "
            f"{t['store_failures'] + t['load_failures']}"
        )
    verdict = "OK" if report["ok"] else "FAILED"
    lines += [
        "",
        f"{verdict}: {report['verified_blocks']} loaded blocks bit-exact, "
        f"{report['mismatched_blocks']} mismatched, {report['failed_load_blocks']} failed "
        f"to load (recomputed), {report['failed_stores']} failed stores",
    ]
    return "\n".join(lines)
