"""The ``kvoffload`` command line: ``plan``, ``inspect``, ``demo``, ``replay``, ``bench``,
``proxy``.

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds its parser and sets ``func`` to a ``run(args) -> int``. What a
user can cause ends in one line on stderr, never a traceback: a bad flag or
configuration (``KVOffloadError``) exits 2, a warning is one
``kvoffload CMD: warning: ...`` line, and a reader that closes the pipe
(``kvoffload plan ... | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from kvoffload import __version__
from kvoffload.cli._flags import USAGE_ERROR, HelpFormatter, Parser, warn_line
from kvoffload.errors import KVOffloadError

__all__ = ["main"]

#: Subcommand modules, in the order ``--help`` lists them.
SUBCOMMANDS = ("plan", "inspect", "demo", "replay", "bench", "proxy")

#: Exit code of a run stopped with Ctrl-C, as shells report SIGINT.
INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvoffload",
        formatter_class=HelpFormatter,
        description="KV-cache offloading for hybrid models: check a configuration (plan), "
        "look inside a disk tier (inspect), watch it work (demo), replay a trace (replay), "
        "measure the tiers (bench), put one address in front of prefill and decode instances "
        "of vllm serve (proxy). 'kvoffload COMMAND --help' explains each.",
    )
    parser.add_argument("--version", action="version", version=f"kvoffload {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"kvoffload.cli.{name}")
        module.register(subparsers)
    return parser


def _one_line_warnings(command: str) -> None:
    """Show every warning as one plain line, not the warnings module's file:line dump."""
    line = warn_line(command)

    def show(message: Warning | str, *where: Any, **more: Any) -> None:
        line(str(message))

    warnings.simplefilter("default")
    warnings.showwarning = show


def _quiet_stdout() -> None:
    """The reader closed the pipe: send what is left to /dev/null so exit flushes nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad flag (one line already printed)
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    try:
        with warnings.catch_warnings():
            _one_line_warnings(args.command)
            code: int = args.func(args)
            sys.stdout.flush()
    except KVOffloadError as exc:
        print(f"kvoffload {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        print(f"kvoffload {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
