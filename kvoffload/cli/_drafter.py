"""The speculative drafter of ``kvoffload plan``, ``demo`` and ``replay``: flags, layout, report.

A drafter's KV is offloaded with the target's, in the groups vLLM puts its
layers in (:mod:`kvoffload.config.hf_drafter`), so ``plan`` shows what it
adds to each chunk; an EAGLE-like drafter also makes every key name the
token after its chunk (``lookahead``), which changes what can hit, so the
plan says so.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.config.hf_drafter import (
    DRAFTERS,
    SPECULATIVE_METHODS,
    drafter_layers,
    with_draft_model,
    with_eagle_head,
)
from kvoffload.config.layout import KVLayout
from kvoffload.config.values import format_bytes
from kvoffload.errors import ConfigError

__all__ = [
    "DRAFTER_FIELDS",
    "add_drafter_flag",
    "add_plan_flags",
    "check_plan_flags",
    "drafter_note",
    "drafter_summary",
    "plan_layout",
]

#: ``plan --json``'s top-level fields on the drafter (docs/cli.md).
DRAFTER_FIELDS = ("speculative_method", "draft_model", "lookahead")


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft-model",
        help="the drafter's model directory or config.json (a draft model, or an EAGLE head): "
        "its layers where vLLM puts them",
    )
    parser.add_argument(
        "--speculative-method",
        choices=SPECULATIVE_METHODS,
        help="vLLM's speculative method of --draft-model (default: draft_model); eagle and "
        "eagle3 put the head's layers in the target's full-attention group and key every "
        "chunk with the token after it",
    )


def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuse a method ``plan`` cannot place, or one without its drafter, before any work."""
    method = args.speculative_method
    if method == "mtp":
        raise ConfigError(
            "--speculative-method mtp is not planned: its layers come from the target's own "
            "config (num_nextn_predict_layers) in each model family's shape, and a multi-module "
            "MTP reads more tokens ahead; the engine reads both from vLLM at start"
        )
    if method is not None and not args.draft_model:
        raise ConfigError(
            f"--speculative-method {method} needs --draft-model: the drafter's model "
            "directory or config.json"
        )


def plan_layout(
    args: argparse.Namespace, layout: KVLayout, source: Callable[[str], Path]
) -> KVLayout:
    """The target's ``layout`` with the drafter's layers (``source``: a model argument's path)."""
    if not args.draft_model:
        return layout
    draft = source(args.draft_model)
    if args.speculative_method in ("eagle", "eagle3"):
        target = source(args.model)
        return with_eagle_head(layout, target, draft, args.dtype, args.block_size,
                               tensor_parallel_size=args.world_size)  # fmt: skip
    return with_draft_model(layout, draft, args.dtype, args.block_size, args.world_size)


def drafter_summary(
    args: argparse.Namespace, config: OffloadConfig, target: KVLayout
) -> dict[str, Any]:
    """``plan --json``'s drafter fields: the method, the drafter, the lookahead, and per group
    the drafter's layers and bytes of a chunk (``target``: the layout without the drafter)."""
    method = (args.speculative_method or "draft_model") if args.draft_model else None
    groups = []
    names = set(target.layer_names)
    for g, layers in enumerate(drafter_layers(config.layout, names)):
        group = config.layout.groups[g]
        pages = dict(zip(group.layer_names, group.layer_pages, strict=True))
        per_rank = sum(pages[name] for name in layers) * config.blocks_per_chunk
        groups.append({"drafter_layers": len(layers), "drafter_chunk_bytes": per_rank})
    return {"speculative_method": method, "draft_model": args.draft_model or None,
            "lookahead": config.layout.lookahead, "groups": groups}  # fmt: skip


def _layers(n: int) -> str:
    return "1 layer" if n == 1 else f"{n} layers"


def drafter_note(summary: dict[str, Any]) -> str:
    """The plan's lines on the drafter: where its layers went, what a chunk holds of them, and
    what its lookahead means for keys and hits; empty without a drafter."""
    method = summary["speculative_method"]
    if method is None:
        return ""
    parts = [
        f"{_layers(g['drafter_layers'])} in group {g['index']} "
        f"({format_bytes(g['drafter_chunk_bytes'])} of its {format_bytes(g['chunk_bytes'])} "
        "chunk)"
        for g in summary["groups"]
        if g.get("drafter_layers")
    ]
    text = f"Drafter ({method}, {summary['draft_model']}): {', '.join(parts)}."
    k = summary["lookahead"]
    if k:
        tokens = "the token" if k == 1 else f"the {k} tokens"
        text += (
            f" Lookahead {k}: its KV at a position reads {tokens} after it, so every chunk's "
            f"key names {tokens} after the chunk; a chunk is stored once known, and a prompt "
            "hits only chunks it holds them for."
        )
    return text


def add_drafter_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default="none",
        help="a speculative drafter of one layer in the full-attention group, offloaded with "
        "the target's KV: draft_model (a separate draft model) or eagle (an EAGLE head: its "
        "KV reads the token after each position, so chunk keys name it: lookahead 1)",
    )
