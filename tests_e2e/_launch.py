"""Run one engine process on a spec (``_runner.py``'s keys) and read its result back.

Shared by the e2e suite's ``engine`` fixture and the benchmarks that drive real engines
(``benchmarks/vllm_ttft.py``): a process per engine keeps runs isolated and lets each set
its own environment. The caller decides what a failure means (a failed test, a stopped
benchmark); :class:`EngineFailed` carries the tail of the process's stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _forkserver import ForkServers

__all__ = ["RUNNER", "EngineFailed", "run_spec"]

RUNNER = Path(__file__).resolve().parent / "_runner.py"


class EngineFailed(Exception):
    """The engine process died or wrote no result; the message holds its stderr's tail."""


def run_spec(
    spec: Mapping[str, Any],
    work: Path,
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    forks: ForkServers | None = None,
) -> dict[str, Any]:
    """Run ``spec`` in a fresh process, or a child of ``forks``; its result, with ``log``: the
    file of its output.

    ``work/name.spec.json``, ``.out.json`` and ``.log`` are left behind for a look
    after a failure.
    """
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    log_path = work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    if forks is not None:
        paths = (spec_path, out_path, log_path)
        rc = forks.run(spec, paths, os.environ if env is None else env, timeout)
        tail = log_path.read_text()[-8000:]
    else:
        proc = subprocess.run(
            [sys.executable, str(RUNNER), str(spec_path), str(out_path)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=None if env is None else dict(env),
        )
        log_path.write_text(proc.stdout + proc.stderr)
        rc, tail = proc.returncode, proc.stderr[-8000:]
    if rc != 0 or not out_path.exists():
        raise EngineFailed(f"engine process failed (rc {rc}, spec {spec_path}):\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["log"] = str(log_path)
    return result
