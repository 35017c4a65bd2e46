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

from kvoffload.errors import ConfigError
from kvoffload.registry import DEFAULT_POLICY, POLICIES

__all__ = ["parse_capacities", "register", "run"]

#: Capacities (chunks) replayed when neither --capacity nor --capacities is given.
DEFAULT_CAPACITIES = (4000, 16000, 64000)


def parse_capacities(text: str, flag: str = "--capacities") -> tuple[int, ...]:
    """``"1000,4000"`` -> ``(1000, 4000)``; anything but positive integers is a ``ConfigError``."""
    capacities: list[int] = []
    for raw in text.split(","):
        item = raw.strip().replace("_", "")
        if not item.isdigit() or int(item) <= 0:
            raise ConfigError(
                f"{flag}: {item!r} is not a positive integer; give chunk counts like 1000,4000"
            )
        capacities.append(int(item))
    return tuple(dict.fromkeys(capacities))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay",
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
    sizes.add_argument("--capacity", help="CPU capacity in chunks")
    sizes.add_argument(
        "--capacities",
        help="comma-separated capacities in chunks (default "
        + ",".join(map(str, DEFAULT_CAPACITIES))
        + ")",
    )
    parser.add_argument(
        "--policy",
        choices=(*POLICIES.names(), "all"),
        default=None,
        help=f"eviction policy, or all (default: {DEFAULT_POLICY}; all with --index-only)",
    )
    parser.add_argument("--gpu-blocks", type=int, default=1000, help="GPU cache blocks (1000)")
    parser.add_argument("--step-tokens", type=int, default=8192, help="tokens per step (8192)")
    parser.add_argument("--index-only", action="store_true", help="the index alone (policy study)")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-bound", action="store_true", help="skip the Belady bound")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--plot", metavar="PNG", help="write hit ratio vs capacity to this PNG")
    parser.set_defaults(func=run)


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{flag}: {value} is not a positive number")


def run(args: argparse.Namespace) -> int:
    from kvoffload.replay import format_table, load_trace, plot_hit_ratio, sweep
    from kvoffload.replay.engine import EngineSettings, format_engine_table, replay_engine

    if args.capacity is not None:
        capacities = parse_capacities(args.capacity, "--capacity")
    elif args.capacities is not None:
        capacities = parse_capacities(args.capacities)
    else:
        capacities = DEFAULT_CAPACITIES
    for value, flag in ((args.limit, "--limit"), (args.gpu_blocks, "--gpu-blocks"),
                        (args.step_tokens, "--step-tokens")):  # fmt: skip
        _positive(value, flag)
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
            replay_engine(trace, capacity, name, settings=settings, progress=progress)
            for capacity in capacities
            for name in policies
        ]
        table = format_engine_table(rows)
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=1))
    else:
        print(
            f"{trace.name}: {len(trace.requests):,} requests, {trace.num_blocks:,} blocks, "
            f"{trace.num_unique:,} distinct"
        )
        print(table)
    if args.plot:
        path = plot_hit_ratio(rows, args.plot)
        if not args.json:
            print(f"plot written to {path}")
    return 0
