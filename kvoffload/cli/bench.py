"""``kvoffload bench``: store and load GB/s of each tier against a same-run reference.

See :mod:`kvoffload.bench` for what is measured. The human output is a table
with the tier/reference ratios; ``--json`` prints one JSON list with a row per
tier and chunk size (:class:`kvoffload.bench.BenchRow`: ``tier``,
``chunk_bytes``, ``store_gbps``, ``load_gbps``, ``ref_store_gbps``,
``ref_load_gbps``, ``direct_io``, and ``lookups_per_s`` / ``ref_lookups_per_s``,
numbers for disk and redis rows and ``null`` for cpu).

``--tier all`` means cpu and disk, plus redis when ``--remote-url`` is given;
``--tier redis`` needs ``--remote-url``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvoffload.bench import BENCH_TIERS, LOCAL_TIERS, BenchRow, run_bench
from kvoffload.cli._flags import HelpFormatter, int_in, number_in, physical_memory
from kvoffload.config.remote_url import RemoteURL, parse_remote_url
from kvoffload.errors import ConfigError

__all__ = ["parse_chunk_mib", "register", "run"]

_MIB = 1 << 20
#: Most MiB one measurement moves: its bytes are allocated at once (source and target).
MAX_TOTAL_MIB = 64 * 1024
#: Largest chunk: a chunk is one allocation and one call; past 4 GiB no engine's is.
MAX_CHUNK_MIB = 4096


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        formatter_class=HelpFormatter,
        help="measure tier store/load GB/s against memcpy, sequential O_DIRECT and redis-py",
        description="Measure each tier's store and load GB/s per chunk size, next to a "
        "reference run on the same bytes: memcpy for cpu, sequential O_DIRECT for disk, "
        "plain redis-py SET/GET (and pipelined EXISTS for lookups) for redis.",
    )
    parser.add_argument(
        "--tier",
        choices=(*BENCH_TIERS, "all"),
        default="all",
        help="the tier to measure; all: cpu and disk, and redis with --remote-url",
    )
    parser.add_argument(
        "--chunk-mib", default="0.25,1,4,16", help="comma-separated chunk sizes in MiB"
    )
    parser.add_argument(
        "--total-mib",
        type=number_in(0, MAX_TOTAL_MIB, "its bytes are allocated in host memory at once"),
        default=256.0,
        help="MiB moved per measurement",
    )
    parser.add_argument(
        "--disk-path", default=None, help="directory for the disk rows (default: $TMPDIR)"
    )
    parser.add_argument(
        "--remote-url",
        default=None,
        help="server for the redis rows, e.g. redis://127.0.0.1:6379/0; its keys are deleted "
        "afterwards (--tier all includes redis only with it)",
    )
    parser.add_argument(
        "--repeat", type=int_in(1, 100), default=3, help="rounds per row; the best is kept"
    )
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
        if size > MAX_CHUNK_MIB * _MIB:
            raise ConfigError(f"--chunk-mib: {part!r} MiB is more than {MAX_CHUNK_MIB} MiB a chunk")
        sizes.append(int(size))
    return sizes


def _check_remote(args: argparse.Namespace) -> RemoteURL | None:
    """The parsed ``--remote-url``, if the chosen tiers use one."""
    if args.remote_url is None:
        if args.tier == "redis":
            raise ConfigError(
                "--tier redis needs --remote-url naming a server, e.g. "
                "--remote-url redis://127.0.0.1:6379/0"
            )
        return None
    if args.tier not in ("redis", "all"):
        raise ConfigError(f"--remote-url is for --tier redis or all, not --tier {args.tier}")
    return parse_remote_url("--remote-url", args.remote_url)


def _check_args(args: argparse.Namespace) -> tuple[list[str], list[int], int]:
    sizes = parse_chunk_mib(args.chunk_mib)
    total = int(args.total_mib * _MIB)
    if total < max(sizes):
        raise ConfigError(f"--total-mib {args.total_mib} is smaller than the largest chunk")
    memory = physical_memory()
    if memory is not None and 2 * total > memory:
        raise ConfigError(
            f"--total-mib {args.total_mib:g}: a measurement holds its bytes twice (source and "
            f"target), more than this machine's {memory / _MIB:,.0f} MiB of memory"
        )
    if args.tier != "all":
        tiers = [args.tier]
    else:
        tiers = list(LOCAL_TIERS) + (["redis"] if args.remote_url is not None else [])
    if "disk" in tiers:
        _check_disk_room(args.disk_path or tempfile.gettempdir(), total)
    return tiers, sizes, total


def _check_disk_room(folder: str, total: int) -> None:
    """The disk rows write ``total`` bytes for the tier and as many for the reference."""
    existing = next(p for p in (Path(folder), *Path(folder).parents) if p.exists())
    try:
        fs = os.statvfs(existing)
    except OSError as exc:
        raise ConfigError(f"--disk-path {folder!r} cannot be used: {exc.strerror}") from exc
    free = fs.f_bavail * fs.f_frsize
    if 2 * total > free:
        raise ConfigError(
            f"--total-mib {total / _MIB:g}: the disk rows write it twice (tier and reference), "
            f"more than the {free / _MIB:,.0f} MiB free under {folder!r}"
        )


#: The reference each tier is measured against, as the table's last column names it.
_REFERENCE = {"cpu": "memcpy", "redis": "redis-py"}


def _reference(row: BenchRow) -> str:
    if row.tier == "disk":
        return "O_DIRECT" if row.direct_io else "buffered"
    return _REFERENCE.get(row.tier, "?")


def _lookups(row: BenchRow) -> str:
    if row.lookups_per_s is None or row.ref_lookups_per_s is None:
        return f" {'-':>9} {'-':>9} {'-':>6} |"
    return (
        f" {row.lookups_per_s:>9,.0f} {row.ref_lookups_per_s:>9,.0f} "
        f"{row.lookup_ratio or 0:>6.0%} |"
    )


def format_table(rows: list[BenchRow]) -> str:
    """The human table: GB/s of tier and reference with their ratio, store then load.

    With a disk or redis row, lookups per second of tier and reference
    (``os.stat`` per file, pipelined ``EXISTS``) follow, ``-`` for tiers that
    do not measure them.
    """
    lookups = any(r.lookups_per_s is not None for r in rows)
    extra = f" {'lookup/s':>9} {'ref':>9} {'ratio':>6} |" if lookups else ""
    head = (
        f"{'tier':<5} {'chunk':>9} | {'store':>6} {'ref':>6} {'ratio':>6} | "
        f"{'load':>6} {'ref':>6} {'ratio':>6} |{extra} io"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.tier:<5} {r.chunk_bytes / _MIB:>5.2f} MiB | {r.store_gbps:>6.2f} "
            f"{r.ref_store_gbps:>6.2f} {r.store_ratio:>6.0%} | {r.load_gbps:>6.2f} "
            f"{r.ref_load_gbps:>6.2f} {r.load_ratio:>6.0%} |{_lookups(r) if lookups else ''} "
            f"{_reference(r)}"
        )
    lines.append(
        "GB/s = 1e9 bytes/s; ref: same-run memcpy (cpu), sequential file I/O and os.stat "
        "(disk) or redis-py SET/GET/pipelined EXISTS (redis)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    tiers, sizes, total = _check_args(args)
    remote_url = _check_remote(args)
    rows = run_bench(
        tiers,
        sizes,
        total,
        disk_path=args.disk_path,
        remote_url=remote_url,
        repeat=args.repeat,
        progress=None if args.json else lambda what: print(f"measuring {what}", file=sys.stderr),
    )
    if args.json:
        print(json.dumps([row.as_json() for row in rows]))
    else:
        print(format_table(rows))
    return 0
