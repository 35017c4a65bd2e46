"""Fixtures of the end-to-end suite: tiny models and an engine per subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _harness import Engine
from _models import GEMMA4, LLAMA, build

RUNNER = Path(__file__).resolve().parent / "_runner.py"


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(LLAMA, tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="session")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(GEMMA4, tmp_path_factory.mktemp("gemma4")))


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    """Run one engine process on a spec (see ``_runner.py``) and return its result."""
    count = iter(range(1000))

    def run(**spec: Any) -> dict[str, Any]:
        n = next(count)
        spec_path, out_path = tmp_path / f"spec{n}.json", tmp_path / f"out{n}.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, str(RUNNER), str(spec_path), str(out_path)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise AssertionError(
                f"engine process failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
            )
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result

    return run
