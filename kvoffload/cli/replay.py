"""``kvoffload replay``: hit ratio and throughput of the eviction policies on a real trace.

It replays a Mooncake-format trace (one JSON request per line with
``hash_ids``; one block is one chunk) through the offload index at one or
more capacities, next to Belady's clairvoyant bound at the same capacity.
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
        help="replay a request trace: hit ratio per policy and capacity, with Belady's bound",
        description=(
            "Replay a Mooncake-format trace (JSON lines with hash_ids, .gz accepted) through "
            "the offload index and report the prefix-hit ratio, keys per second and the "
            "clairvoyant (Belady) bound at each capacity."
        ),
    )
    parser.add_argument("trace", help="trace file (.jsonl or .jsonl.gz)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--capacity", help="capacity in chunks")
    sizes.add_argument(
        "--capacities",
        help="comma-separated capacities in chunks (default "
        + ",".join(map(str, DEFAULT_CAPACITIES))
        + ")",
    )
    parser.add_argument(
        "--policy",
        choices=(*POLICIES.names(), "all"),
        default="all",
        help=f"eviction policy, or all (default all; the index default is {DEFAULT_POLICY})",
    )
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-bound", action="store_true", help="skip the Belady bound")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--plot", metavar="PNG", help="write hit ratio vs capacity to this PNG")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvoffload.replay import format_table, load_trace, plot_hit_ratio, sweep

    if args.capacity is not None:
        capacities = parse_capacities(args.capacity, "--capacity")
    elif args.capacities is not None:
        capacities = parse_capacities(args.capacities)
    else:
        capacities = DEFAULT_CAPACITIES
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit: {args.limit} is not a positive number of requests")
    policies = POLICIES.names() if args.policy == "all" else (args.policy,)
    trace = load_trace(args.trace, limit=args.limit)
    progress = not args.json and sys.stderr.isatty()
    rows = sweep(trace, capacities, policies, bound=not args.no_bound, progress=progress)
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=1))
    else:
        print(
            f"{trace.name}: {len(trace.requests):,} requests, {trace.num_blocks:,} blocks, "
            f"{trace.num_unique:,} distinct"
        )
        print(format_table(rows))
    if args.plot:
        path = plot_hit_ratio(rows, args.plot)
        if not args.json:
            print(f"plot written to {path}")
    return 0
