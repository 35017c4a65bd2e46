"""Bounded flag types and the parser every subcommand shares.

Each numeric flag has a range, checked by argparse before any work starts:
a number past it would otherwise surface as a ``MemoryError`` in the index or
a refused tensor allocation minutes later. A refusal is one line on stderr
and exit 2 (:class:`Parser`), as every other user error of the CLI is.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "USAGE_ERROR",
    "HelpFormatter",
    "Parser",
    "int_in",
    "number_in",
    "physical_memory",
    "warn_line",
]

#: Exit code for an error the user caused (bad flag, bad configuration).
USAGE_ERROR = 2


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions wrapped to the terminal, tables (text with line breaks) kept as written;
    every option with a default says it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = default not in (None, False, argparse.SUPPRESS) and "default" not in text
        if shown and action.option_strings:
            text += f" (default: {default})"
        return text


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what was wrong, and where help is."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _range_text(low: float, high: float, why: str) -> str:
    reason = f" ({why})" if why else ""
    return f"a number from {low:,} to {high:,}{reason}"


def int_in(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``; ``why`` says what the maximum protects."""

    def parse(text: str) -> int:
        item = text.strip().replace("_", "")
        digits = item[1:] if item[:1] in "+-" else item
        if not digits.isdigit() or len(digits) > 30:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        value = int(item)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{value:,} is out of range: give {_range_text(low, high, why)}"
            )
        return value

    parse.__name__ = "integer"
    return parse


def number_in(low: float, high: float, why: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number in ``(low, high]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or not low < value <= high:
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: give a number above {low:g} and at most {high:g}"
                + (f" ({why})" if why else "")
            )
        return value

    parse.__name__ = "number"
    return parse


def warn_line(command: str) -> Callable[[str], None]:
    """Where a subcommand's notes go: one ``kvoffload CMD: warning: ...`` line on stderr."""

    def warn(message: str) -> None:
        print(f"kvoffload {command}: warning: {' '.join(message.split())}", file=sys.stderr)

    return warn


def physical_memory() -> int | None:
    """Bytes of memory this machine has, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
