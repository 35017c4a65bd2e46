"""Where the e2e suite's minutes go: a record of every engine process it ran.

Each record splits a process's wall time into vLLM's engine start (``LLM(...)``, which
the runner times), the passes it generated, and the rest: Python, torch and vLLM
imports, and the shutdown. ``make e2e`` prints the summary at the end of the run
(``conftest.pytest_terminal_summary``), so a new test's cost shows where it lands.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

__all__ = ["RUNS", "EngineRun", "record", "summary"]


@dataclass(frozen=True)
class EngineRun:
    test: str
    wall_s: float
    start_s: float
    generate_s: float
    forked: bool = False

    @property
    def other_s(self) -> float:
        return self.wall_s - self.start_s - self.generate_s


RUNS: list[EngineRun] = []


def _current_test() -> str:
    """The running test's file and name (pytest's own variable), or ``?`` outside one."""
    return os.environ.get("PYTEST_CURRENT_TEST", "? (?)").rsplit(" (", 1)[0]


def record(result: dict[str, Any], wall_s: float, *, forked: bool) -> None:
    """Note one engine process's result (``_runner.py``'s) and its wall time."""
    generate = sum(float(p.get("seconds") or 0.0) for p in result.get("passes", []))
    start = float(result.get("start_seconds") or 0.0)
    RUNS.append(EngineRun(_current_test(), wall_s, start, generate, forked))


def summary(top: int = 15) -> list[str]:
    """The totals and the test files that spent most on engine processes."""
    if not RUNS:
        return []
    total = EngineRun("all", *(sum(getattr(r, f) for r in RUNS)
                               for f in ("wall_s", "start_s", "generate_s")))  # fmt: skip
    forked = sum(r.forked for r in RUNS)
    lines = [
        f"{len(RUNS)} engine processes ({forked} forked), {total.wall_s:.0f} s: engine start "
        f"{total.start_s:.0f} s, generate {total.generate_s:.0f} s, "
        f"imports and exit {total.other_s:.0f} s"
    ]
    by_file: dict[str, list[EngineRun]] = defaultdict(list)
    for run in RUNS:
        by_file[run.test.split("::", 1)[0]].append(run)
    ranked = sorted(by_file.items(), key=lambda item: -sum(r.wall_s for r in item[1]))
    for name, runs in ranked[:top]:
        wall, start = sum(r.wall_s for r in runs), sum(r.start_s for r in runs)
        gen = sum(r.generate_s for r in runs)
        lines.append(f"  {name:<34} {len(runs):3d} runs {wall:6.0f} s "
                     f"(start {start:4.0f}, generate {gen:4.0f})")  # fmt: skip
    return lines
