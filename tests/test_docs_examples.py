"""The ``kvoffload plan`` outputs the README and docs/cli.md show are what the command prints:
every line shown (``...`` stands for lines left out) is a line of the real output."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvoffload.cli import main

ROOT = Path(__file__).resolve().parents[1]


def shown_runs(page: Path) -> list[tuple[list[str], list[str]]]:
    """(argv, lines shown) of each ``kvoffload plan`` example of a page: a ``bash`` block of
    one command followed by its output block, or an output block whose first line is
    ``$ kvoffload plan ...``."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)
    runs = []
    for i, (lang, body) in enumerate(blocks):
        lines = body.splitlines()
        if lines and lines[0].startswith("$ kvoffload plan "):
            runs.append((shlex.split(lines[0][2:])[1:], lines[1:]))
        elif lang == "bash" and body.startswith("kvoffload plan ") and i + 1 < len(blocks):
            command = body.replace("\\\n", " ").splitlines()[0]
            runs.append((shlex.split(command)[1:], blocks[i + 1][1].splitlines()))
    return runs


@pytest.mark.parametrize("page", ["README.md", "docs/cli.md"])
def test_the_plan_output_shown_is_the_commands(
    page: str, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = shown_runs(ROOT / page)
    assert runs, f"{page} shows no kvoffload plan run"
    for argv, shown in runs:
        assert main(argv) == 0, argv
        printed = capsys.readouterr().out.splitlines()
        missing = [line for line in shown if line != "..." and line not in printed]
        assert not missing, f"{page}: `kvoffload {shlex.join(argv)}` does not print {missing}"
