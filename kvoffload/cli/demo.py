"""``kvoffload demo``: the connector's real path on a hybrid model, every loaded byte checked.

On the bundled Gemma-4-like layout (``tiny_gemma4``: three sliding-window
groups of 256-token blocks and a full-attention group of 16-token blocks,
KV tensors in vLLM's CPU-backend layout), the bundled trace (shared system
prompts, multi-turn conversations) is served by the connector's own
scheduler and worker sides, driven by the stand-in for vLLM
(:mod:`kvoffload.standin`: vLLM's step order, a GPU prefix cache too
small to keep everything). Its hit rules, loads and stores move real bytes
through the engine, a CPU tier and a disk tier; every block a load fills is
checked bit-exact. The exit code is 1 if any block came back wrong or any
store failed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvoffload.config import build_offloading_config
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.config.values import format_bytes
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.replay.engine import engine_requests
from kvoffload.replay.trace import load_trace
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.tiers.disk import DiskProbe
from kvoffload.transfer import allocate_kv_caches

__all__ = ["register", "run"]


def _bundled(name: str) -> Path:
    return Path(str(resources.files("kvoffload") / "examples" / name))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="serve a trace through the connector's real path on a hybrid model; verify every byte",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--requests", type=int, default=None, help="serve only the first N")
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake-format trace (JSONL)")
    parser.add_argument("--disk-path", default=None, help="disk tier directory (default: temp)")
    parser.add_argument("--cpu-bytes", default="16MiB", help="CPU tier budget (default 16MiB)")
    parser.add_argument("--disk-bytes", default="1GiB", help="disk tier budget (default 1GiB)")
    parser.add_argument("--blocks-per-chunk", type=int, default=2, help="default 2")
    parser.add_argument("--gpu-blocks", type=int, default=320, help="GPU cache blocks (320)")
    parser.add_argument("--device", default="cpu", help="the KV tensors' device: cpu or cuda")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=run)


def serve(args: argparse.Namespace, disk_path: str) -> dict[str, Any]:
    """Serve the trace; return the report (see :func:`render`)."""
    if args.requests is not None and args.requests <= 0:
        raise ConfigError(f"--requests must be positive, got {args.requests}")
    if args.gpu_blocks <= 0:
        raise ConfigError(f"--gpu-blocks must be positive, got {args.gpu_blocks}")
    if args.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu")
    layout = layout_from_hf_config(_bundled("tiny_gemma4.json"), "bfloat16", 16)
    extra = {
        "cpu_bytes_to_use": args.cpu_bytes,
        "blocks_per_chunk": args.blocks_per_chunk,
        "disk_path": disk_path,
        "disk_bytes_to_use": args.disk_bytes,
    }
    config = build_offloading_config(extra, layout)
    trace = load_trace(args.trace or _bundled("demo_trace.jsonl"), limit=args.requests)
    namespace = namespace_of("kvoffload-demo", "bfloat16", layout)
    kv = allocate_kv_caches(layout, args.gpu_blocks, device=args.device)
    side = KVOffloadSide(config, namespace, kv, [DiskProbe(Path(disk_path), namespace)])
    engine = StandIn(layout, side, gpu_blocks=args.gpu_blocks, kv=KVPages(layout, kv))
    try:
        stats = engine.run(engine_requests(trace, progress=not args.no_progress, desc="demo"))
    finally:
        side.close()
    assert side.worker is not None  # a side that moves bytes has one
    figures, worker = side.scheduler.figures(), side.worker.figures()
    tiers = side.worker.engine.stats()
    failed_stores = figures["failed_store_chunks"]
    return {
        "ok": stats.mismatched_blocks == 0 and failed_stores == 0,
        "requests": stats.requests, "seconds": stats.seconds, "steps": stats.steps,
        "gpu_blocks": args.gpu_blocks, "device": args.device,
        "prompt_tokens": stats.prompt_tokens,
        "gpu_hit_tokens": stats.gpu_hit_tokens, "loaded_tokens": stats.loaded_tokens,
        "failed_load_tokens": stats.failed_load_tokens,
        **{name: figures[name] for name in ("cpu_hit_chunks", "lower_hit_chunks",
                                             "stored_chunks", "skipped_store_chunks")},
        "tiers": {
            name: {"stored_bytes": t.store_bytes, "store_gbps": t.store_gbps,
                   "loaded_bytes": t.load_bytes, "load_gbps": t.load_gbps,
                   "failures": t.store_failures + t.dropped + t.load_failures + t.corrupt}
            for name, t in tiers.items()
        },
        "verified_blocks": stats.verified_blocks, "mismatched_blocks": stats.mismatched_blocks,
        "failed_load_jobs": worker.get("failed_load_jobs", 0), "failed_stores": failed_stores,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.disk_path is not None:
        report = serve(args, args.disk_path)
    else:
        with tempfile.TemporaryDirectory(prefix="kvoffload-demo-") as tmp:
            report = serve(args, tmp)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1


def _share(tokens: int, prompt: int) -> str:
    return f"{tokens:>8}  {tokens / prompt:6.1%}"


def render(report: dict[str, Any]) -> str:
    prompt = report["prompt_tokens"] or 1
    computed = prompt - report["gpu_hit_tokens"] - report["loaded_tokens"]
    lines = [
        f"kvoffload demo: {report['requests']} requests in {report['seconds']:.1f} s "
        f"({report['steps']} engine steps, GPU prefix cache of {report['gpu_blocks']} blocks, "
        f"KV tensors on {report['device']})",
        "",
        f"prompt tokens         {report['prompt_tokens']:>8}",
        f"  GPU prefix cache    {_share(report['gpu_hit_tokens'], prompt)}",
        f"  loaded by kvoffload {_share(report['loaded_tokens'], prompt)}  "
        f"({report['cpu_hit_chunks']} chunks from CPU, {report['lower_hit_chunks']} from disk)",
        f"  computed            {_share(computed, prompt)}",
        "",
        "tier  stored       GB/s  loaded       GB/s  failures",
    ]  # fmt: skip
    for name, t in report["tiers"].items():
        lines.append(
            f"{name:<4}  {format_bytes(t['stored_bytes']):>10}  {t['store_gbps']:>5.2f}  "
            f"{format_bytes(t['loaded_bytes']):>10}  {t['load_gbps']:>5.2f}  {t['failures']}"
        )
    verdict = "OK" if report["ok"] else "FAILED"
    lines += [
        "",
        f"{verdict}: {report['verified_blocks']} loaded blocks bit-exact, "
        f"{report['mismatched_blocks']} mismatched, {report['failed_load_jobs']} failed loads "
        f"(recomputed), {report['failed_stores']} failed stores",
    ]
    return "\n".join(lines)
