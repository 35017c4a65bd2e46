"""``kvoffload plan``: show the groups of a model and what an offloading budget holds.

It runs the same validation as the engine adapter, so a configuration that
``plan`` accepts starts; one it rejects prints the one-line ``ConfigError``.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from importlib import resources
from pathlib import Path
from typing import Any

from kvoffload.cli._drafter import (
    DRAFTER_FIELDS,
    add_plan_flags,
    check_plan_flags,
    drafter_note,
    drafter_summary,
)
from kvoffload.cli._drafter import plan_layout as with_drafter
from kvoffload.cli._flags import HelpFormatter, int_in, warn_line
from kvoffload.cli._plan_summary import PLAN_SCHEMA, plan_summary
from kvoffload.cli._resolved import resolved_choices
from kvoffload.config import OffloadConfig, build_offloading_config
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.config.keys import IGNORED_KEYS, KEYS
from kvoffload.config.layout import Reuse
from kvoffload.config.roles import KVRole
from kvoffload.config.values import format_bytes, safe_repr
from kvoffload.connector._hits import coarse_state_hits
from kvoffload.errors import ConfigError

__all__ = ["EXAMPLES", "PLAN_SCHEMA", "example_path", "plan_summary", "register", "run"]

#: Model configs shipped in the package, usable by name: ``kvoffload plan tiny_gemma4``.
EXAMPLES = ("tiny_gemma4", "tiny_llama", "tiny_deepseek_v4", "tiny_qwen3_next", "tiny_llama4")
_HYBRID = {"auto": None, "on": True, "off": False}
DEFAULT_EXTRA = '{"cpu_bytes_to_use": "1GiB"}'
#: The largest --block-size: vLLM's are at most a few thousand tokens (hybrid models raise
#: theirs to fit a state); past this a chunk outgrows any budget for the wrong reason.
MAX_BLOCK_SIZE = 1 << 16


def example_path(name: str) -> Path:
    """Path of a bundled example config."""
    return Path(str(resources.files("kvoffload") / "examples" / f"{name}.json"))


#: Columns of the key table in ``plan --help``.
_HELP_WIDTH = 110


def _key_help() -> str:
    """The keys of --extra-config as an aligned table in plain words (no Markdown)."""
    keys = [key for key in KEYS if not key.ignored]
    rows = [(key.name, key.type.label, key.default_text().strip("`")) for key in keys]
    widths = [max(len(row[c]) for row in rows) for c in range(3)]
    indent = sum(widths) + 8
    lines = []
    for key, row in zip(keys, rows, strict=True):
        meaning = key.meaning.replace("`", "") + (
            f" Range: {key.range_text()}." if key.bounds else ""
        )
        head = "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        body = textwrap.wrap(meaning, width=max(40, _HELP_WIDTH - indent))
        lines.append(f"{head}  {body[0]}")
        lines.extend(" " * indent + line for line in body[1:])
    ignored = "accepted and ignored (vLLM's own connector's keys): " + ", ".join(
        sorted(IGNORED_KEYS)
    )
    lines += textwrap.wrap(ignored, _HELP_WIDTH, initial_indent="  ", subsequent_indent="    ")
    header = "  " + "  ".join(
        t.ljust(w) for t, w in zip(("key", "type", "default"), widths, strict=True)
    )
    return "keys of --extra-config:\n" + header + "  meaning\n" + "\n".join(lines)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        formatter_class=HelpFormatter,
        help="check an offloading configuration against a model; show its groups and budget",
        description="Check an offloading configuration (vLLM's kv_connector_extra_config) "
        "against a model's KV cache layout with the same rules as engine start, and show "
        "what each KV cache group needs for a hit and what the CPU budget holds.",
        epilog=_key_help(),
    )
    parser.add_argument(
        "model",
        help=f"model directory, its config.json, or a bundled example: {', '.join(EXAMPLES)}",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="KV cache dtype, as vLLM's --kv-cache-dtype (fp8_ds_mla: DeepSeek-V4 only)",
    )
    parser.add_argument(
        "--block-size",
        type=int_in(1, MAX_BLOCK_SIZE, "vLLM's block sizes are at most a few thousand tokens"),
        default=16,
        help="the engine's tokens per KV cache block (vLLM's --block-size)",
    )
    parser.add_argument(
        "--extra-config",
        default=DEFAULT_EXTRA,
        help="kv_connector_extra_config as JSON, or @FILE to read it from a file",
    )
    parser.add_argument(
        "--world-size",
        type=int_in(1, 1 << 16),
        default=1,
        help="tensor-parallel ranks sharing the budgets: plans one rank's layout (KV heads "
        "split, MLA latents whole) and says what is stored once and what per rank",
    )
    parser.add_argument(
        "--kv-role",
        choices=[role.value for role in KVRole],
        default=KVRole.BOTH.value,
        help="vLLM's kv_role: kv_producer (a prefill instance: stores, never loads), "
        "kv_consumer (a decode instance: loads; stores with consumer_write_back), kv_both",
    )
    parser.add_argument(
        "--hybrid",
        choices=list(_HYBRID),
        default="auto",
        help="vLLM's hybrid KV cache allocator (auto: vLLM's default, off for chunked local "
        "attention unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1)",
    )
    add_plan_flags(parser)
    parser.add_argument(
        "--json", action="store_true", help="print JSON instead of a table (schema: docs/cli.md)"
    )
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


def _group_table(summary: dict[str, Any]) -> list[str]:
    """One row per group: what a hit needs of it, its page, what the tiers keep of it for the
    tensor-parallel ranks (with more than one), what the CPU tier holds of it alone."""
    ranks = summary["world_size"]
    shared = ("ranks",) if ranks > 1 else ()
    rows: list[tuple[str, ...]] = [
        ("group", "kind", "a hit at H needs", "page (one layer)", *shared, "CPU tier alone")
    ]
    for entry in summary["groups"]:
        holds = (
            f"{entry['cpu_states_if_alone']} states"
            if "cpu_states_if_alone" in entry
            else f"{entry['cpu_tokens_if_alone']} tokens"
        )
        shares = (_ranks_text(entry, ranks),) if ranks > 1 else ()
        rows.append(
            (str(entry["index"]), entry["kind"], entry["needs"], entry["page"], *shares, holds)
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _ranks_text(entry: dict[str, Any], world_size: int) -> str:
    """What the tiers keep of a group's chunk for ``world_size`` tensor-parallel ranks."""
    if entry["tensor_parallel"] == "replicated":
        return f"one copy, {world_size} ranks load it"
    return f"{world_size} shards, one per rank"


def _copies(config: OffloadConfig) -> str:
    """How the ranks share the tiers, in one sentence; empty for one rank."""
    ranks = config.world_size
    if ranks == 1:
        return ""
    if config.copies == 1:
        return (
            f" Every group is replicated: each chunk is stored once for all {ranks} "
            "ranks (one CPU slot, one disk file, one remote value) and every rank loads "
            "it, so the budgets hold what they hold at one rank."
        )
    mixed = any(g.replicated for g in config.layout.groups)
    note = (
        " (a replicated group beside sharded ones is stored per rank too, for now)" if mixed else ""
    )
    return (
        f" Sharded groups: each of the {ranks} ranks stores its shard of every chunk "
        f"under its own key{note}, in its 1/{ranks} of the budgets (sizes above are one "
        "rank's shard)."
    )


def _holds(config: OffloadConfig, summary: dict[str, Any]) -> str:
    """What the CPU tier holds, in one sentence."""
    head = (
        f"The CPU tier holds {config.num_cpu_chunks} chunks per worker "
        f"({format_bytes(config.max_chunk_bytes)} slots): a shared prefix of "
        f"{summary['cpu_prefix_tokens']} tokens"
    )
    if all(group.reuse is Reuse.PREFIX for group in config.layout.groups):
        return f"{head}, every chunk of it.{_copies(config)} Per group:"
    return (
        f"{head} with a hit point at its end and every retention step "
        f"({_retention_note(config)}).{_copies(config)} Per group:"
    )


def run(args: argparse.Namespace) -> int:
    check_plan_flags(args)
    target = layout_from_hf_config(
        _model_source(args.model),
        dtype=args.dtype,
        block_size=args.block_size,
        hybrid=_HYBRID[args.hybrid],
        tensor_parallel_size=args.world_size,
    )
    layout = with_drafter(args, target, _model_source, _HYBRID[args.hybrid])
    config = build_offloading_config(
        _extra_config(args.extra_config),
        layout,
        world_size=args.world_size,
        kv_role=args.kv_role,
        warn=warn_line("plan"),
    )
    drafter = drafter_summary(args, config, target)
    summary = plan_summary(
        config,
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        hybrid=args.hybrid,
        **{k: drafter[k] for k in DRAFTER_FIELDS},
    )
    if drafter["speculative_method"] is not None:
        for entry, extra in zip(summary["groups"], drafter["groups"], strict=True):
            entry.update(extra)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(config)
    for name, (choice, why) in resolved_choices(config).items():
        print(f"{name + ' (auto)':<20} {choice} here: {why}")
    print(f"\n{_holds(config, summary)}\n")
    print("\n".join(_group_table(summary)))
    if (coarse := coarse_state_hits(config.layout, config.tokens_per_chunk)) is not None:
        print(f"\nNote: {coarse}.")
    if note := drafter_note(summary):
        print("\n" + "\n".join(textwrap.wrap(note, _HELP_WIDTH)))
    return 0
