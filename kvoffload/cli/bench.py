"""``kvoffload bench``: store and load GB/s of each tier against a same-run reference.

See :mod:`kvoffload.bench` for what is measured. The human output is a table
with the tier/reference ratios; ``--json`` prints one JSON list with a row per
tier and chunk size.
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from typing import Any

from kvoffload.bench import BENCH_TIERS, BenchRow, run_bench
from kvoffload.errors import ConfigError

__all__ = ["parse_chunk_mib", "register", "run"]

_MIB = 1 << 20


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure tier store/load GB/s against memcpy and sequential O_DIRECT",
        description="Measure each tier's store and load GB/s per chunk size, next to a "
        "reference run on the same bytes: memcpy for cpu, sequential O_DIRECT for disk.",
    )
    parser.add_argument("--tier", choices=(*BENCH_TIERS, "all"), default="all")
    parser.add_argument(
        "--chunk-mib",
        default="0.25,1,4,16",
        help="comma-separated chunk sizes in MiB (default 0.25,1,4,16)",
    )
    parser.add_argument(
        "--total-mib", type=float, default=256.0, help="bytes moved per measurement (default 256)"
    )
    parser.add_argument(
        "--disk-path", default=None, help="directory for the disk rows (default: TMPDIR)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds per row; the best is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON list of rows")
    parser.set_defaults(func=run)


def parse_chunk_mib(text: str) -> list[int]:
    """``"0.25,1"`` -> ``[262144, 1048576]``; sizes must be whole positive byte counts."""
    sizes = []
    for part in text.split(","):
        try:
            size = Fraction(part.strip()) * _MIB
        except (ValueError, ZeroDivisionError) as exc:
            raise ConfigError(f"--chunk-mib: {part!r} is not a number; use e.g. 0.25,1,4") from exc
        if size <= 0 or size.denominator != 1:
            raise ConfigError(f"--chunk-mib: {part!r} MiB is not a positive whole number of bytes")
        sizes.append(int(size))
    return sizes


def _check_args(args: argparse.Namespace) -> tuple[list[str], list[int], int]:
    sizes = parse_chunk_mib(args.chunk_mib)
    total = int(args.total_mib * _MIB)
    if total < max(sizes):
        raise ConfigError(f"--total-mib {args.total_mib} is smaller than the largest chunk")
    if args.repeat <= 0:
        raise ConfigError(f"--repeat must be a positive int, got {args.repeat}")
    tiers = list(BENCH_TIERS) if args.tier == "all" else [args.tier]
    return tiers, sizes, total


def format_table(rows: list[BenchRow]) -> str:
    """The human table: GB/s of tier and reference with their ratio, store then load."""
    head = (
        f"{'tier':<5} {'chunk':>9} | {'store':>6} {'ref':>6} {'ratio':>6} | "
        f"{'load':>6} {'ref':>6} {'ratio':>6} | io"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        io = "memcpy" if r.tier == "cpu" else ("O_DIRECT" if r.direct_io else "buffered")
        lines.append(
            f"{r.tier:<5} {r.chunk_bytes / _MIB:>5.2f} MiB | {r.store_gbps:>6.2f} "
            f"{r.ref_store_gbps:>6.2f} {r.store_ratio:>6.0%} | {r.load_gbps:>6.2f} "
            f"{r.ref_load_gbps:>6.2f} {r.load_ratio:>6.0%} | {io}"
        )
    lines.append("GB/s = 1e9 bytes/s; ref: same-run memcpy (cpu) or sequential file I/O (disk)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    tiers, sizes, total = _check_args(args)
    rows = run_bench(
        tiers,
        sizes,
        total,
        disk_path=args.disk_path,
        repeat=args.repeat,
        progress=None if args.json else lambda what: print(f"measuring {what}", file=sys.stderr),
    )
    if args.json:
        print(json.dumps([row.as_json() for row in rows]))
    else:
        print(format_table(rows))
    return 0
