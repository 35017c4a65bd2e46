"""``kvoffload replay``: hit ratio and scheduler cost of the connector on a real trace.

By default a Mooncake-format trace (one JSON request per line with
``hash_ids`` of 512-token blocks) is served through the connector's own
scheduler and worker sides, with the stand-in for vLLM in front
(:mod:`kvoffload.replay.engine`): a GPU prefix cache of ``--gpu-blocks``
blocks, the real hit rules of every group kind, real stores and loads.
``--index-only`` replays the offload index alone instead, one request at a
time, next to Belady's clairvoyant bound: the eviction-policy study.
``--arrivals`` sends each request at its ``timestamp`` instead, so requests
wait in the engine's queue and a client's retention hints come with them
(:mod:`kvoffload.replay.arrivals`), next to LRU and Belady.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvoffload.cli._drafter import add_drafter_flag
from kvoffload.cli._flags import HelpFormatter, int_in, number_in
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
    _add_arrival_flags(parser)
    add_drafter_flag(parser)
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="also write hit ratio against capacity to this PNG (needs matplotlib)",
    )
    parser.set_defaults(func=run)


def _add_arrival_flags(parser: Any) -> None:
    """The flags of the arrival replay (``--arrivals``)."""
    parser.add_argument(
        "--arrivals",
        action="store_true",
        help="send each request at its timestamp: requests queue, hints arrive with them",
    )
    parser.add_argument(
        "--load",
        type=number_in(0, 0.99, "at 1 or more the queue grows without bound"),
        help="with --arrivals: the share of the engine's prefill rate the trace offers "
        "(default: 0.9)",
    )
    parser.add_argument(
        "--hints",
        help="with --arrivals: the clients replayed, comma-separated: none, perfect (the "
        "trace's knowledge of which turns continue), or an accuracy such as 0.8 "
        "(default: none,perfect,0.8)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int_in(1, 1 << 16),
        default=512,
        help="tokens per hash id of the trace (Mooncake: 512; the Claude Code trace: 64)",
    )


def run(args: argparse.Namespace) -> int:
    from kvoffload.config.hf_drafter import with_drafter_layer
    from kvoffload.replay import load_trace, plot_hit_ratio
    from kvoffload.replay.arrival_report import parse_hint_modes
    from kvoffload.replay.engine import trace_layout
    from kvoffload.replay.plot import check_plot_path

    _check_mode(args)
    modes = parse_hint_modes(args.hints or "none,perfect,0.8") if args.arrivals else ()
    layout = with_drafter_layer(trace_layout(args.block_tokens), args.drafter)
    if args.capacity is not None:
        capacities = parse_capacities(args.capacity, "--capacity")
    elif args.capacities is not None:
        capacities = parse_capacities(args.capacities)
    else:
        capacities = DEFAULT_CAPACITIES
    if args.plot:
        check_plot_path(args.plot)
    trace = load_trace(args.trace, limit=args.limit, block_tokens=args.block_tokens)
    progress = not args.json and sys.stderr.isatty()
    if args.arrivals:
        rows, table, about = _arrival_rows(args, trace, capacities, modes, progress)
    else:
        rows, table, about = _rows(args, trace, layout, capacities, progress)
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=1))
    else:
        drafter = f"; drafter: {args.drafter}" if args.drafter != "none" else ""
        ahead = f" (lookahead {layout.lookahead})" if layout.lookahead else ""
        print(
            f"{trace.name}: {len(trace.requests):,} requests, {trace.num_blocks:,} blocks, "
            f"{trace.num_unique:,} distinct{drafter}{ahead}{about}"
        )
        print(table)
    if args.plot:
        path = plot_hit_ratio(rows, args.plot)
        if not args.json:
            print(f"plot written to {path}")
    return 0


def _check_mode(args: argparse.Namespace) -> None:
    """Flags that cannot go together, refused before any work."""
    if args.index_only and args.drafter != "none":
        raise ConfigError(
            f"--drafter {args.drafter} needs the engine replay: --index-only replays the offload "
            "index alone, with no KV for a drafter to add to"
        )
    if args.arrivals and (args.index_only or args.drafter != "none"):
        other = "--index-only" if args.index_only else f"--drafter {args.drafter}"
        raise ConfigError(
            f"--arrivals and {other} do not go together: the arrival replay serves the trace "
            "through the connector, one full-attention group, no drafter"
        )
    if not args.arrivals:
        for flag, value in (("--load", args.load), ("--hints", args.hints)):
            if value is not None:
                raise ConfigError(f"{flag} needs --arrivals (requests sent at their timestamps)")


def _rows(
    args: argparse.Namespace,
    trace: Any,
    layout: Any,
    capacities: tuple[int, ...],
    progress: bool,
) -> tuple[list[Any], str, str]:
    """The index-only or the engine replay's rows and table."""
    from kvoffload.replay import format_table, sweep
    from kvoffload.replay.engine import EngineSettings, format_engine_table, replay_engine

    policy = args.policy or ("all" if args.index_only else DEFAULT_POLICY)
    policies = POLICIES.names() if policy == "all" else (policy,)
    if args.index_only:
        rows = sweep(trace, capacities, policies, bound=not args.no_bound, progress=progress)
        return list(rows), format_table(rows), ""
    settings = EngineSettings(gpu_blocks=args.gpu_blocks, step_tokens=args.step_tokens)
    engine_rows = [
        replay_engine(trace, capacity, name, layout=layout, settings=settings, progress=progress)
        for capacity in capacities
        for name in policies
    ]
    return list(engine_rows), format_engine_table(engine_rows), ""


def _arrival_rows(
    args: argparse.Namespace,
    trace: Any,
    capacities: tuple[int, ...],
    modes: Any,
    progress: bool,
) -> tuple[list[Any], str, str]:
    """The arrival replay's rows: each policy beside LRU, each client, Belady per capacity."""
    from kvoffload.replay.arrival_report import format_arrival_table, sweep_arrivals
    from kvoffload.replay.arrivals import service_rate
    from kvoffload.replay.engine import EngineSettings

    load = 0.9 if args.load is None else args.load
    rate = service_rate(trace, load)  # refuses a trace without timestamps, before any work
    policy = args.policy or DEFAULT_POLICY
    policies = POLICIES.names() if policy == "all" else tuple(dict.fromkeys((policy, "lru")))
    settings = EngineSettings(gpu_blocks=args.gpu_blocks, step_tokens=args.step_tokens)
    rows = sweep_arrivals(
        trace, capacities, policies, modes, load=load, settings=settings, progress=progress
    )
    about = (
        f"; arrivals at an offered load of {load:g}: a prefill rate of {rate:,.0f} tokens/s, "
        f"{args.gpu_blocks:,} GPU blocks"
    )
    return list(rows), format_arrival_table(rows), about
