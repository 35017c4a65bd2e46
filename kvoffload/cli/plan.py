"""``kvoffload plan``: show the groups of a model and what an offloading budget holds.

It runs the same validation as the engine adapter, so a configuration that
``plan`` accepts starts; one it rejects prints the one-line ``ConfigError``.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path
from typing import Any

from kvoffload.config import OffloadConfig, build_offloading_config
from kvoffload.config.hf_drafter import with_draft_model
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.config.keys import KEYS
from kvoffload.config.layout import CacheGroup, Reuse
from kvoffload.config.values import format_bytes, safe_repr
from kvoffload.connector._hits import coarse_state_hits, needed_chunks
from kvoffload.errors import ConfigError

__all__ = ["EXAMPLES", "example_path", "register", "run"]

#: Model configs shipped in the package, usable by name: ``kvoffload plan tiny_gemma4``.
EXAMPLES = ("tiny_gemma4", "tiny_llama", "tiny_deepseek_v4", "tiny_qwen3_next", "tiny_llama4")
_HYBRID = {"auto": None, "on": True, "off": False}


def example_path(name: str) -> Path:
    """Path of a bundled example config."""
    return Path(str(resources.files("kvoffload") / "examples" / f"{name}.json"))


def register(subparsers: Any) -> None:
    keys = "\n".join(
        f"  {key.name:<20} {key.type.label:<11} {key.default_text().strip('`'):<9} {key.meaning}"
        + (f" Range: {key.range_text()}." if key.bounds else "")
        for key in KEYS
        if not key.ignored
    )
    parser = subparsers.add_parser(
        "plan",
        help="show a model's KV cache groups and what the CPU budget holds",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Validate an offloading configuration against a model's KV cache layout.",
        epilog=f"keys of --extra-config (name, type, default, meaning):\n{keys}",
    )
    parser.add_argument(
        "model",
        help=f"model directory, config.json, or a bundled example: {', '.join(EXAMPLES)}",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="KV cache dtype (default bfloat16; fp8_ds_mla for DeepSeek-V4 on FlashMLA)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="engine tokens per block (default 16)"
    )
    parser.add_argument(
        "--extra-config",
        default='{"cpu_bytes_to_use": "1GiB"}',
        help="kv_connector_extra_config as JSON, or @FILE (default: 1 GiB of CPU memory)",
    )
    parser.add_argument("--world-size", type=int, default=1, help="workers sharing the budget")
    parser.add_argument(
        "--hybrid",
        choices=list(_HYBRID),
        default="auto",
        help="vLLM's hybrid KV cache allocator (auto: vLLM's default, off for chunked local "
        "attention unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1)",
    )
    parser.add_argument(
        "--draft-model",
        help="a draft model (speculative method draft_model): its layers where vLLM puts them",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _model_source(model: str) -> Path:
    path = Path(model)
    if not path.exists() and model in EXAMPLES:
        return example_path(model)
    return path


def _extra_config(text: str) -> Any:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read --extra-config file {text[1:]!r}: {exc}") from exc
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # a number over 4300 digits, deep nesting
        raise ConfigError(f"--extra-config is not valid JSON ({exc}): {safe_repr(text)}") from exc


def _retention_note(config: OffloadConfig) -> str:
    if config.retention_step == 0:
        return "none: retention_interval 0"
    return f"{config.retention_step} tokens"


def _needs(group: CacheGroup) -> str:
    """What a hit at ``H`` needs from ``group``, in words."""
    if group.reuse is Reuse.STATE:
        per = "one state" if group.num_layers == 1 else f"{group.num_layers} states, one a layer"
        return f"the state at H ({per})"
    if group.attention_chunk_size is not None:
        return f"tokens since H's {group.attention_chunk_size}-token chunk"
    if group.sliding_window is not None:
        return f"the {group.sliding_window} tokens before H"
    return "every token before H"


def _page_text(group: CacheGroup, engine_page: int) -> str:
    if group.reuse is Reuse.STATE:
        padded = f" (page {format_bytes(engine_page)})" if engine_page > group.page_bytes else ""
        return f"{format_bytes(group.page_bytes)} state{padded}"
    pages = sorted(set(group.layer_pages))
    if len(pages) == 1:
        return format_bytes(pages[0])
    return f"{format_bytes(pages[0])}..{format_bytes(pages[-1])} ({len(pages)} sizes)"


#: The longest prefix ``cpu_prefix_tokens`` considers: past any context window.
MAX_PREFIX = 1 << 24


def prefix_chunks(config: OffloadConfig, tokens: int) -> int:
    """Chunks a prefix of ``tokens`` tokens keeps: every chunk of the full-prefix groups,
    and of window and state groups what its hit points need (its end, every retention step).

    A window's chunks only move right as the hit point grows, so the union of
    the points' windows is one sweep.
    """
    step = config.retention_step
    points = [*range(step, tokens, step), tokens] if step else [tokens]
    total = 0
    for group, span in zip(config.layout.groups, config.tokens_per_chunk, strict=True):
        if group.reuse is Reuse.PREFIX:
            total += tokens // span
            continue
        reached = 0
        for point in points:
            needed = needed_chunks(group, span, 0, point)
            total += max(0, needed.stop - max(needed.start, reached))
            reached = max(reached, needed.stop)
    return total


def cpu_prefix_tokens(config: OffloadConfig) -> int:
    """The longest prefix (on a hit boundary, at most ``MAX_PREFIX``) the CPU tier holds."""
    align, room = config.hit_alignment, config.num_cpu_chunks
    low, high = 0, MAX_PREFIX // align
    while low < high:  # the chunks a prefix keeps grow with it
        mid = (low + high + 1) // 2
        if prefix_chunks(config, mid * align) <= room:
            low = mid
        else:
            high = mid - 1
    return low * align


def plan_summary(config: OffloadConfig) -> dict[str, Any]:
    """Machine-readable plan: groups, chunk geometry and what the CPU budget holds."""
    groups = []
    for group, span, size in zip(
        config.layout.groups, config.tokens_per_chunk, config.chunk_bytes, strict=True
    ):
        entry: dict[str, Any] = {
            "kind": group.kind,
            "reuse": group.reuse.value,
            "window": group.sliding_window or group.attention_chunk_size,
            "layers": group.num_layers,
            "tokens_per_block": group.tokens_per_block,
            "page_bytes": list(group.layer_pages) if group.layer_page_bytes else group.page_bytes,
            "tokens_per_chunk": span,
            "chunk_bytes": size,
        }
        if group.reuse is Reuse.STATE:
            entry["cpu_states_if_alone"] = config.num_cpu_chunks
        else:
            entry["cpu_tokens_if_alone"] = config.num_cpu_chunks * span
        groups.append(entry)
    return {
        "groups": groups,
        "blocks_per_chunk": config.blocks_per_chunk,
        "eviction_policy": config.eviction_policy,
        "cpu_bytes_to_use": config.cpu_bytes_to_use,
        "world_size": config.world_size,
        "cpu_chunks_per_worker": config.num_cpu_chunks,
        "cpu_prefix_tokens": cpu_prefix_tokens(config),
        "disk_path": config.disk_path,
        "disk_chunks": config.num_disk_chunks,
    }


def _group_table(config: OffloadConfig, summary: dict[str, Any]) -> list[str]:
    """One row per group: what a hit needs of it, its page, what the CPU tier holds of it alone."""
    layout = config.layout
    engine_page = max((g.page_bytes for g in layout.groups if g.reuse is not Reuse.STATE),
                      default=0)  # fmt: skip
    rows = [("group", "kind", "a hit at H needs", "page (one layer)", "CPU tier alone")]
    for i, (group, entry) in enumerate(zip(layout.groups, summary["groups"], strict=True)):
        holds = (
            f"{entry['cpu_states_if_alone']} states"
            if group.reuse is Reuse.STATE
            else f"{entry['cpu_tokens_if_alone']} tokens"
        )
        rows.append((str(i), group.kind, _needs(group), _page_text(group, engine_page), holds))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def run(args: argparse.Namespace) -> int:
    layout = layout_from_hf_config(
        _model_source(args.model),
        dtype=args.dtype,
        block_size=args.block_size,
        hybrid=_HYBRID[args.hybrid],
    )
    if args.draft_model:
        layout = with_draft_model(layout, _model_source(args.draft_model), args.dtype,
                                  args.block_size)  # fmt: skip
    config = build_offloading_config(
        _extra_config(args.extra_config), layout, world_size=args.world_size
    )
    summary = plan_summary(config)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(config)
    print(
        f"\nThe CPU tier holds {config.num_cpu_chunks} chunks per worker "
        f"({format_bytes(config.max_chunk_bytes)} slots): a shared prefix of "
        f"{summary['cpu_prefix_tokens']} tokens with a hit point at its end and every "
        f"retention step ({_retention_note(config)}). Per group:\n"
    )
    print("\n".join(_group_table(config, summary)))
    if (coarse := coarse_state_hits(config.layout, config.tokens_per_chunk)) is not None:
        print(f"\nNote: {coarse}.")
    return 0
