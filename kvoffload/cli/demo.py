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
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvoffload.cli._drafter import add_drafter_flag
from kvoffload.cli._flags import HelpFormatter, int_in, physical_memory, warn_line
from kvoffload.config import build_offloading_config
from kvoffload.config.hf_drafter import with_drafter_layer
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.config.values import Bounds, format_bytes, to_size
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.replay.engine import engine_requests
from kvoffload.replay.trace import load_trace
from kvoffload.standin import KVOffloadSide, KVPages, StandIn, StandInStats
from kvoffload.tiers.disk import DiskProbe
from kvoffload.tiers.disk.inspect import stored_chunks
from kvoffload.transfer import allocate_kv_caches

__all__ = ["register", "run"]

#: Most GPU blocks the demo allocates: 4 GiB of KV tensors at its 256 KiB a block.
MAX_GPU_BLOCKS = 1 << 14


def _bundled(name: str) -> Path:
    return Path(str(resources.files("kvoffload") / "examples" / name))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        formatter_class=HelpFormatter,
        help="serve a trace through the connector's real path on a hybrid model; verify every byte",
        description="Serve a trace (by default the bundled one: shared system prompts, "
        "multi-turn conversations) on a small Gemma-4-like model (three sliding-window groups "
        "and a full-attention group) through the connector's own scheduler and worker, with a "
        "stand-in for vLLM in front whose GPU prefix cache is too small to keep everything. "
        "Loads and stores move real bytes through a CPU tier and a disk tier, and every block "
        "a load fills is checked bit-exact. Exit code 1 if any block came back wrong or any "
        "store failed.",
    )
    parser.add_argument(
        "--requests", type=int_in(1, 1 << 40), help="serve only the first N requests of the trace"
    )
    parser.add_argument(
        "--trace", type=Path, help="a Mooncake-format trace (JSON lines; default: the bundled one)"
    )
    parser.add_argument(
        "--disk-path", help="the disk tier's directory (default: a temporary one, removed after)"
    )
    parser.add_argument("--cpu-bytes", default="16MiB", help="the CPU tier's budget")
    parser.add_argument("--disk-bytes", default="1GiB", help="the disk tier's budget")
    parser.add_argument(
        "--blocks-per-chunk", type=int_in(1, 1024), default=2, help="engine blocks per chunk"
    )
    parser.add_argument(
        "--gpu-blocks",
        type=int_in(1, MAX_GPU_BLOCKS, "4 GiB of KV tensors"),
        default=320,
        help="blocks of the stand-in engine's GPU prefix cache (256 KiB each)",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the KV tensors live"
    )
    add_drafter_flag(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none anyway when stderr is not a terminal)",
    )
    parser.set_defaults(func=run)


def serve(args: argparse.Namespace, disk_path: str) -> dict[str, Any]:
    """Serve the trace; return the report (see :func:`render`)."""
    _check_memory(args.cpu_bytes)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu")
    target = layout_from_hf_config(_bundled("tiny_gemma4.json"), "bfloat16", 16)
    layout = with_drafter_layer(target, args.drafter)
    extra = {
        "cpu_bytes_to_use": args.cpu_bytes,
        "blocks_per_chunk": args.blocks_per_chunk,
        "disk_path": disk_path,
        "disk_bytes_to_use": args.disk_bytes,
    }
    try:
        config = build_offloading_config(extra, layout, warn=warn_line("demo"))
    except ConfigError as exc:  # name the demo's flags, not the keys they set
        raise ConfigError(_flag_names(str(exc))) from exc
    trace = load_trace(args.trace or _bundled("demo_trace.jsonl"), limit=args.requests)
    namespace = namespace_of("kvoffload-demo", "bfloat16", layout)
    reused = stored_chunks(disk_path, namespace)
    kv = allocate_kv_caches(layout, args.gpu_blocks, device=args.device)
    side = KVOffloadSide(config, namespace, kv, [DiskProbe(Path(disk_path), namespace)])
    engine = StandIn(layout, side, gpu_blocks=args.gpu_blocks, kv=KVPages(layout, kv))
    try:
        progress = not args.no_progress and sys.stderr.isatty()
        stats = engine.run(engine_requests(trace, progress=progress, desc="demo"))
    finally:
        side.close()
    served = _served(stats, side)
    return {
        "ok": stats.mismatched_blocks == 0 and served["failed_stores"] == 0,
        "requests": stats.requests,
        "seconds": stats.seconds,
        "steps": stats.steps,
        "gpu_blocks": args.gpu_blocks,
        "device": args.device,
        "drafter": args.drafter,
        "lookahead": layout.lookahead,
        **served,
        "disk_path": disk_path,
        "reused_disk_chunks": reused,
    }


def _served(stats: StandInStats, side: KVOffloadSide) -> dict[str, Any]:
    """What the run moved and checked: tokens, chunks, each tier's bytes, failures."""
    assert side.worker is not None  # a side that moves bytes has one
    sched, worker = side.scheduler.stats(), side.worker.stats()
    tiers = side.worker.engine.stats()
    return {
        "prompt_tokens": stats.prompt_tokens,
        "gpu_hit_tokens": stats.gpu_hit_tokens,
        "loaded_tokens": stats.loaded_tokens,
        "failed_load_tokens": stats.failed_load_tokens,
        **{
            name: sched[name]
            for name in (
                "cpu_hit_chunks",
                "lower_hit_chunks",
                "stored_chunks",
                "skipped_store_chunks",
            )
        },
        "tiers": {
            name: {
                "stored_bytes": t.store_bytes,
                "store_gbps": t.store_gbps,
                "loaded_bytes": t.load_bytes,
                "load_gbps": t.load_gbps,
                "failures": t.store_failures + t.dropped + t.load_failures + t.corrupt,
            }
            for name, t in tiers.items()
        },
        "verified_blocks": stats.verified_blocks,
        "mismatched_blocks": stats.mismatched_blocks,
        "failed_load_jobs": worker.get("failed_load_jobs", 0),
        "failed_stores": sched["failed_store_chunks"],
    }


#: The configuration keys the demo's flags set, as its messages name them.
_FLAGS = {
    "cpu_bytes_to_use": "--cpu-bytes",
    "disk_bytes_to_use": "--disk-bytes",
    "blocks_per_chunk": "--blocks-per-chunk",
    "disk_path": "--disk-path",
}


def _flag_names(message: str) -> str:
    for key, flag in _FLAGS.items():
        message = message.replace(f"'{key}'", flag)
    return message


def _check_memory(cpu_bytes: str) -> None:
    """The CPU tier is allocated at start: refuse a budget past this machine's memory."""
    budget = to_size("--cpu-bytes", cpu_bytes, Bounds(1, 2**60))
    memory = physical_memory()
    if memory is not None and budget > memory:
        raise ConfigError(
            f"--cpu-bytes {cpu_bytes} is more than this machine's {format_bytes(memory)} of memory"
        )


def run(args: argparse.Namespace) -> int:
    if args.disk_path is not None:
        report = serve(args, args.disk_path)
    else:
        with tempfile.TemporaryDirectory(prefix="kvoffload-demo-") as tmp:
            report = serve(args, tmp)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1


def _drafter_text(report: dict[str, Any]) -> str:
    drafter = report.get("drafter", "none")
    if drafter == "none":
        return ""
    ahead = f", lookahead {report['lookahead']}" if report.get("lookahead") else ""
    return f", drafter: {drafter}{ahead}"


def _share(tokens: int, prompt: int) -> str:
    return f"{tokens:>8}  {tokens / prompt:6.1%}"


def render(report: dict[str, Any]) -> str:
    prompt = report["prompt_tokens"] or 1
    computed = prompt - report["gpu_hit_tokens"] - report["loaded_tokens"]
    lines = [
        f"kvoffload demo: {report['requests']} requests in {report['seconds']:.1f} s "
        f"({report['steps']} engine steps, GPU prefix cache of {report['gpu_blocks']} blocks, "
        f"KV tensors on {report['device']}{_drafter_text(report)})",
        "",
        f"prompt tokens         {report['prompt_tokens']:>8}",
        f"  GPU prefix cache    {_share(report['gpu_hit_tokens'], prompt)}",
        f"  loaded by kvoffload {_share(report['loaded_tokens'], prompt)}  "
        f"({report['cpu_hit_chunks']} chunks from CPU, {report['lower_hit_chunks']} from disk)",
        f"  computed            {_share(computed, prompt)}",
        "",
        "tier  stored       GB/s  loaded       GB/s  failures",
    ]
    for name, t in report["tiers"].items():
        lines.append(
            f"{name:<4}  {format_bytes(t['stored_bytes']):>10}  {t['store_gbps']:>5.2f}  "
            f"{format_bytes(t['loaded_bytes']):>10}  {t['load_gbps']:>5.2f}  {t['failures']}"
        )
    if report.get("reused_disk_chunks"):
        lines += [
            "",
            f"reused: {report['disk_path']} already held {report['reused_disk_chunks']} chunks "
            "of this demo from an earlier run; loads from disk may use them, so the figures "
            "can differ from a fresh run's",
        ]
    verdict = "OK" if report["ok"] else "FAILED"
    lines += [
        "",
        f"{verdict}: {report['verified_blocks']} loaded blocks bit-exact, "
        f"{report['mismatched_blocks']} mismatched, {report['failed_load_jobs']} failed loads "
        f"(recomputed), {report['failed_stores']} failed stores",
    ]
    return "\n".join(lines)
