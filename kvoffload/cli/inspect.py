"""``kvoffload inspect DISK_PATH``: what a disk tier holds, read without changing anything.

Safe beside running engines: the shared index is opened read-only and
nothing is created, repaired or deleted (:mod:`kvoffload.tiers.disk.inspect`).
The exit code is 1 when a damaged file was found, so a script can check a
cache with it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

from kvoffload.cli._flags import HelpFormatter
from kvoffload.config.values import format_bytes
from kvoffload.tiers.disk.inspect import DiskReport, inspect_disk

__all__ = ["INSPECT_SCHEMA", "register", "report_json", "run"]

#: Version of ``inspect --json``'s layout (docs/cli.md); raised only when a field changes
#: meaning or goes away, never when one is added.
INSPECT_SCHEMA = 1
#: Damaged entries listed per namespace in the table (``--json`` lists them all).
_SHOWN = 5


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        formatter_class=HelpFormatter,
        help="show what a disk tier directory holds (read-only; safe beside running engines)",
        description="Show a disk tier's namespaces (one per model, dtype and layout, and per "
        "tensor-parallel rank where KV heads are split across ranks; one for all ranks of an "
        "MLA model), their chunks and bytes, the oldest and newest use, the free "
        "space, and any damaged file. Nothing is created, repaired or deleted. Exit code 1 "
        "when a damaged file is found.",
    )
    parser.add_argument("disk_path", metavar="DISK_PATH", help="the disk_path of an engine")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also read every chunk and check its checksum (reads the whole cache)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (schema in docs/cli.md)")
    parser.set_defaults(func=run)


def report_json(report: DiskReport) -> dict[str, Any]:
    """The ``--json`` document: the report's fields plus the schema version."""
    return {"schema": INSPECT_SCHEMA, **asdict(report), "damaged": report.damaged}


def _when(ns: int | None) -> str:
    if ns is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def render(report: DiskReport) -> str:
    index = (
        f"{report.chunks} chunks, {format_bytes(report.used_bytes)} held, "
        f"{format_bytes(report.reserved_bytes)} reserved by stores in flight"
        if report.index_found
        else "no index (no engine has used this directory)"
    )
    lines = [
        f"disk tier at {report.path}",
        f"index: {index}",
        f"file system: {format_bytes(report.free_bytes)} free of {format_bytes(report.fs_bytes)}"
        " (each engine's disk_bytes_to_use is its own setting; the index records none)",
        "",
    ]
    rows = [("namespace", "chunks", "bytes", "files", "oldest use", "newest use", "damaged")]
    for ns in report.namespaces:
        rows.append(
            (
                ns.namespace,
                str(ns.indexed),
                format_bytes(ns.indexed_bytes),
                str(ns.files),
                _when(ns.oldest_use_ns),
                _when(ns.newest_use_ns),
                str(len(ns.damaged)),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if not report.namespaces:
        lines.append("(no namespace: nothing stored yet)")
    for ns in report.namespaces:
        for entry in ns.damaged[:_SHOWN]:
            lines.append(f"damaged in {ns.namespace[:8]}: {entry}")
        if len(ns.damaged) > _SHOWN:
            lines.append(f"damaged in {ns.namespace[:8]}: ... {len(ns.damaged) - _SHOWN} more")
    if report.foreign:
        lines.append(f"not kvoffload's: {', '.join(report.foreign[:_SHOWN])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = inspect_disk(args.disk_path, verify=args.verify)
    print(json.dumps(report_json(report), indent=2) if args.json else render(report))
    return 1 if report.damaged else 0
