"""``kvoffload replay``: hit ratio and scheduler cost of the connector on a real trace.

By default a Mooncake-format trace (one JSON request per line with
``hash_ids`` of 512-token blocks) is served through the connector's own
scheduler and worker sides, with the stand-in for vLLM in front
(:mod:`kvoffload.replay.engine`): a GPU prefix cache of ``--gpu-blocks``
blocks, the real hit rules of every group kind, real stores and loads.
``--index-only`` replays the offload index alone instead, one request at a
time, next to Belady's clairvoyant bound: the eviction-policy study.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvoffload.cli._drafter import add_drafter_flag
from kvoffload.cli._flags import HelpFormatter, int_in
from kvoffload.errors import ConfigError
from kvoffload.registry import DEFAULT_POLICY, POLICIES

__all__ = ["MAX_CAPACITY", "parse_capacities", "register", "run"]

#: Capacities (chunks) replayed when neither --capacity nor --capacities is given.
DEFAULT_CAPACITIES = (4000, 16000, 64000)
#: Most chunks (and GPU blocks) a replay may ask for: the engine replay gives each a 1 KiB
#: slot, so 2^22 is 4 GiB of host memory, and the index a free-list entry each.
MAX_CAPACITY = 1 << 22
_MEMORY = "each chunk or block takes a 1 KiB slot of host memory"


def parse_capacities(text: str, flag: str = "--capacities") -> tuple[int, ...]:
    """``"1000,4000"`` -> ``(1000, 4000)``; anything but positive integers is a ``ConfigError``."""
    capacities: list[int] = []
    for raw in text.split(","):
        item = raw.strip().replace("_", "")
        if not item.isdigit() or len(item) > 20 or not 0 < int(item) <= MAX_CAPACITY:
            raise ConfigError(
                f"{flag}: {item!r} is not a chunk count from 1 to {MAX_CAPACITY:,} ({_MEMORY}); "
                "give chunk counts like 1000,4000"
            )
        capacities.append(int(item))
    return tuple(dict.fromkeys(capacities))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay",
        formatter_class=HelpFormatter,
        help="replay a request trace through the connector: hit ratio and scheduler cost",
        description=(
            "Serve a Mooncake-format trace (JSON lines with hash_ids, .gz accepted) through the "
            "connector's scheduler and worker with a simulated vLLM engine in front, and report "
            "the connector's hit ratio and its scheduler milliseconds per engine step; with "
            "--index-only, replay the offload index alone, next to the Belady bound."
        ),
    )
    parser.add_argument("trace", help="trace file (.jsonl or .jsonl.gz)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--capacity", help="the CPU tier's capacity in chunks (one trace block each)"
    )
    sizes.add_argument(
        "--capacities",
        help="comma-separated capacities in chunks (default: "
        + ",".join(map(str, DEFAULT_CAPACITIES))
        + ")",
    )
    parser.add_argument(
        "--policy",
        choices=(*POLICIES.names(), "all"),
        default=None,
        help=f"eviction policy, or all (default: {DEFAULT_POLICY}; all with --index-only)",
    )
    parser.add_argument(
        "--gpu-blocks",
        type=int_in(1, MAX_CAPACITY, _MEMORY),
        default=1000,
        help="blocks of the simulated engine's GPU prefix cache",
    )
    parser.add_argument(
        "--step-tokens",
        type=int_in(1, 1 << 24, "2^24 tokens, past any context window"),
        default=8192,
        help="tokens the simulated engine computes per step (vLLM's max_num_batched_tokens)",
    )
    parser.add_argument(
        "--index-only",
        action="store_true",
        help="replay the offload index alone, next to the Belady bound (the policy study)",
    )
    parser.add_argument(
        "--limit", type=int_in(1, 1 << 40), help="replay only the first N requests of the trace"
    )
    parser.add_argument("--no-bound", action="store_true", help="skip the Belady bound")
    add_drafter_flag(parser)
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="also write hit ratio against capacity to this PNG (needs matplotlib)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvoffload.config.hf_drafter import with_drafter_layer
    from kvoffload.replay import format_table, load_trace, plot_hit_ratio, sweep
    from kvoffload.replay.engine import (
        EngineSettings,
        format_engine_table,
        replay_engine,
        trace_layout,
    )
    from kvoffload.replay.plot import check_plot_path

    if args.index_only and args.drafter != "none":
        raise ConfigError(
            f"--drafter {args.drafter} needs the engine replay: --index-only replays the offload "
            "index alone, with no KV for a drafter to add to"
        )
    layout = with_drafter_layer(trace_layout(), args.drafter)
    if args.capacity is not None:
        capacities = parse_capacities(args.capacity, "--capacity")
    elif args.capacities is not None:
        capacities = parse_capacities(args.capacities)
    else:
        capacities = DEFAULT_CAPACITIES
    if args.plot:
        check_plot_path(args.plot)
    policy = args.policy or ("all" if args.index_only else DEFAULT_POLICY)
    policies = POLICIES.names() if policy == "all" else (policy,)
    trace = load_trace(args.trace, limit=args.limit)
    progress = not args.json and sys.stderr.isatty()
    rows: list[Any]
    if args.index_only:
        rows = sweep(trace, capacities, policies, bound=not args.no_bound, progress=progress)
        table = format_table(rows)
    else:
        settings = EngineSettings(gpu_blocks=args.gpu_blocks, step_tokens=args.step_tokens)
        rows = [
            replay_engine(
                trace, capacity, name, layout=layout, settings=settings, progress=progress
            )
            for capacity in capacities
            for name in policies
        ]
        table = format_engine_table(rows)
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=1))
    else:
        drafter = f"; drafter: {args.drafter}" if args.drafter != "none" else ""
        ahead = f" (lookahead {layout.lookahead})" if layout.lookahead else ""
        print(
            f"{trace.name}: {len(trace.requests):,} requests, {trace.num_blocks:,} blocks, "
            f"{trace.num_unique:,} distinct{drafter}{ahead}"
        )
        print(table)
    if args.plot:
        path = plot_hit_ratio(rows, args.plot)
        if not args.json:
            print(f"plot written to {path}")
    return 0
