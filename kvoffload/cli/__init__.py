"""The ``kvoffload`` command line: ``plan``, ``replay``, ``bench``, ``demo``.

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds its parser and sets ``func`` to a ``run(args) -> int``. Errors a
user can cause (``ConfigError`` and other ``KVOffloadError``) print one line
and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvoffload.errors import KVOffloadError

__all__ = ["main"]

#: Subcommand modules, in the order ``--help`` lists them.
SUBCOMMANDS = ("plan", "demo", "replay", "bench")

#: Exit code for an error the user caused (bad flag, bad configuration).
USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvoffload",
        description="KV-cache offloading for hybrid models: plan, replay, bench, demo.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"kvoffload.cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except KVOffloadError as exc:
        print(f"kvoffload {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
