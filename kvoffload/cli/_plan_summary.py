"""What ``kvoffload plan`` computes, apart from how it prints it: the machine-readable plan
(``plan --json``, :func:`plan_summary`) and what the CPU tier holds of a shared prefix
(:func:`cpu_prefix_tokens`).

:mod:`kvoffload.cli.plan` is the command: its flags, its help, and the text it renders
from this summary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvoffload.cli._resolved import resolved_choices
from kvoffload.config import OffloadConfig
from kvoffload.config.layout import CacheGroup, Reuse
from kvoffload.config.values import format_bytes
from kvoffload.connector._hits import needed_chunks

__all__ = ["MAX_PREFIX", "PLAN_SCHEMA", "cpu_prefix_tokens", "plan_summary", "prefix_chunks"]

#: Version of ``plan --json``'s layout (docs/cli.md): raised only when a field changes
#: meaning or goes away, never when one is added.
PLAN_SCHEMA = 1


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


def _group_entry(config: OffloadConfig, index: int, engine_page: int) -> dict[str, Any]:
    group = config.layout.groups[index]
    span, size = config.tokens_per_chunk[index], config.chunk_bytes[index]
    entry: dict[str, Any] = {
        "index": index,
        "kind": group.kind,
        "reuse": group.reuse.value,
        "window": group.sliding_window or group.attention_chunk_size,
        "needs": _needs(group),
        "layers": group.num_layers,
        "tokens_per_block": group.tokens_per_block,
        "page_bytes": list(group.layer_pages) if group.layer_page_bytes else group.page_bytes,
        "page": _page_text(group, engine_page),
        "tokens_per_chunk": span,
        "chunk_bytes": size,
        "tensor_parallel": "replicated" if group.replicated else "sharded",
    }
    if group.reuse is Reuse.STATE:
        entry["cpu_states_if_alone"] = config.num_cpu_chunks
    else:
        entry["cpu_tokens_if_alone"] = config.num_cpu_chunks * span
    return entry


def plan_summary(config: OffloadConfig, **model: Any) -> dict[str, Any]:
    """Machine-readable plan: every setting, the groups, what the budgets hold.

    ``model`` names what was planned (``model``, ``dtype``, ``block_size``,
    ``hybrid``). Every ``OffloadConfig`` field but the layout is a top-level
    field of its name, so a new key appears here by itself (docs/cli.md).
    """
    layout = config.layout
    engine_page = max(
        (g.page_bytes for g in layout.groups if g.reuse is not Reuse.STATE), default=0
    )
    settings = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "layout"
    }
    return {
        "schema": PLAN_SCHEMA,
        **model,
        **settings,
        "groups": [_group_entry(config, i, engine_page) for i in range(len(layout.groups))],
        "cpu_chunks_per_worker": config.num_cpu_chunks,
        "chunk_copies": config.copies,
        "cpu_slot_bytes": config.max_chunk_bytes,
        "cpu_prefix_tokens": cpu_prefix_tokens(config),
        "hit_alignment": config.hit_alignment,
        "retention_step": config.retention_step,
        "disk_chunks": config.num_disk_chunks,
        "resolved": {name: choice for name, (choice, _) in resolved_choices(config).items()},
    }
