"""Running the real ``kvoffload`` command in child processes, as a user's shell does,
or in this process where a test reads its stderr many times over."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

from kvoffload import cli

#: Longest a command of these tests may take before the test fails (not a speed claim:
#: only a hang must not stall the suite).
_HANG_S = 300


class Ran(NamedTuple):
    code: int
    out: str
    err: str


def _command(argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "kvoffload", *argv]


def kvoffload(*argv: str | Path, cwd: Path | None = None) -> Ran:
    """Run ``kvoffload ARGV...`` to its end."""
    done = subprocess.run(
        _command([str(a) for a in argv]),
        capture_output=True,
        text=True,
        check=False,
        timeout=_HANG_S,
        cwd=cwd,
    )
    return Ran(done.returncode, done.stdout, done.stderr)


def kvoffload_all(commands: Sequence[Sequence[str | Path]]) -> list[Ran]:
    """Run several ``kvoffload`` commands at once (their start-up dominates), in order."""
    children = [
        subprocess.Popen(
            _command([str(a) for a in argv]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in commands
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=_HANG_S)
        results.append(Ran(child.returncode, out, err))
    return results


def assert_one_line(ran: Ran, fragment: str, *, code: int = 2, kind: str = "error") -> None:
    """Exit ``code``, exactly one line on stderr, saying ``kind`` and ``fragment``."""
    lines = ran.err.strip().splitlines()
    assert "Traceback" not in ran.err, ran.err
    assert ran.code == code, (ran.code, ran.err)
    assert len(lines) == 1, ran.err
    assert f": {kind}: " in lines[0], lines[0]
    assert fragment in lines[0], lines[0]


def assert_plan_refuses(
    capsys: pytest.CaptureFixture[str], model: str, args: Sequence[str], fragment: str
) -> None:
    """``kvoffload plan MODEL ARGS`` in this process (``--model M`` among ``args`` plans M
    instead): exit 2 and one error line holding ``fragment``."""
    args = list(args)
    if "--model" in args:
        model = args.pop(args.index("--model") + 1)
        args.remove("--model")
    assert cli.main(["plan", model, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvoffload plan: error: ") and fragment in err
