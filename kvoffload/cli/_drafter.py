"""The speculative drafter of ``kvoffload plan``, ``demo`` and ``replay``: flags, layout, report.

A drafter's KV is offloaded with the target's, in the groups vLLM puts its
layers in (:mod:`kvoffload.config.hf_drafter`), so ``plan`` shows what it
adds to each chunk; an EAGLE-like drafter also makes every key name the
token after its chunk (``lookahead``), which changes what can hit, so the
plan says so. ``mtp`` takes no drafter model, as in vLLM: its layers are the
target's own (``plan MODEL --speculative-method mtp``), and how far they read
ahead depends on ``--num-speculative-tokens``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.cli._flags import int_in
from kvoffload.config import OffloadConfig
from kvoffload.config.hf_drafter import (
    DRAFTERS,
    SPECULATIVE_METHODS,
    drafter_layers,
    with_draft_model,
    with_eagle_head,
    with_mtp,
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
DRAFTER_FIELDS = ("speculative_method", "draft_model", "num_speculative_tokens", "lookahead")
#: The largest --num-speculative-tokens: vLLM's drafters propose a few tokens a step; past
#: this a lookahead outgrows any chunk for the wrong reason.
MAX_SPECULATIVE_TOKENS = 64


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
        "chunk with the token after it; mtp (no --draft-model) adds the target's own MTP "
        "layers (DeepSeek-V3, Qwen3-Next, Qwen3.5)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int_in(1, MAX_SPECULATIVE_TOKENS, "vLLM's drafters propose a few tokens a step"),
        help="vLLM's num_speculative_tokens (default with mtp: one per MTP module); several "
        "MTP modules at several tokens read that many tokens after each position",
    )


def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuse flags that do not go together, before any work: ``mtp`` with a drafter model,
    another method without one, a token count without a method."""
    method = args.speculative_method
    if method == "mtp" and args.draft_model:
        raise ConfigError(
            "--speculative-method mtp takes no --draft-model: the MTP layers are the target's "
            'own, as in vLLM\'s speculative_config={"method": "mtp"}; drop --draft-model'
        )
    if method not in (None, "mtp") and not args.draft_model:
        raise ConfigError(
            f"--speculative-method {method} needs --draft-model: the drafter's model "
            "directory or config.json"
        )
    if args.num_speculative_tokens is not None and method is None and not args.draft_model:
        raise ConfigError(
            "--num-speculative-tokens needs a drafter: --speculative-method mtp, or --draft-model"
        )


def plan_layout(
    args: argparse.Namespace,
    layout: KVLayout,
    source: Callable[[str], Path],
    hybrid: bool | None = None,
) -> KVLayout:
    """The target's ``layout`` with the drafter's layers (``source``: a model argument's path;
    ``hybrid``: vLLM's hybrid allocator, for an MTP target grouped again with its layers)."""
    if args.speculative_method == "mtp":
        return with_mtp(
            source(args.model),
            args.num_speculative_tokens,
            dtype=args.dtype,
            block_size=args.block_size,
            hybrid=hybrid,
            tensor_parallel_size=args.world_size,
        )[0]
    if not args.draft_model:
        return layout
    draft = source(args.draft_model)
    if args.speculative_method in ("eagle", "eagle3"):
        target = source(args.model)
        return with_eagle_head(
            layout, target, draft, args.dtype, args.block_size, tensor_parallel_size=args.world_size
        )
    return with_draft_model(layout, draft, args.dtype, args.block_size, args.world_size)


def drafter_summary(
    args: argparse.Namespace, config: OffloadConfig, target: KVLayout
) -> dict[str, Any]:
    """``plan --json``'s drafter fields: the method, the drafter, the draft tokens, the
    lookahead, and per group the drafter's layers, their names and the bytes of a chunk
    (``target``: the layout without the drafter)."""
    method = args.speculative_method
    if args.draft_model:
        method = method or "draft_model"
    groups = []
    names = set(target.layer_names)
    for g, layers in enumerate(drafter_layers(config.layout, names)):
        group = config.layout.groups[g]
        pages = dict(zip(group.layer_names, group.layer_pages, strict=True))
        per_rank = sum(pages[name] for name in layers) * config.blocks_per_chunk
        groups.append(
            {
                "drafter_layers": len(layers),
                "drafter_chunk_bytes": per_rank,
                "drafter_layer_names": layers,
            }
        )
    tokens = args.num_speculative_tokens
    if method == "mtp" and tokens is None:  # vLLM's default: one per module
        tokens = sum(g["drafter_layers"] for g in groups)
    return {
        "speculative_method": method,
        "draft_model": args.draft_model or None,
        "num_speculative_tokens": tokens,
        "lookahead": config.layout.lookahead,
        "groups": groups,
    }


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
    drafted = summary["num_speculative_tokens"]
    source = summary["draft_model"] or "the target's own MTP layers"
    drafts = f", {drafted} speculative token{'s' if drafted != 1 else ''}" if drafted else ""
    text = f"Drafter ({method}, {source}{drafts}): {', '.join(parts)}."
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
