"""``kvoffload demo`` end to end (small), and the bundled trace matches its generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.cli._demo_trace import generate_demo_trace

BUNDLED = Path(__file__).resolve().parents[1] / "kvoffload" / "examples" / "demo_trace.jsonl"


def test_demo_runs_verifies_and_reports_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["demo", "--requests", "12", "--disk-path", str(tmp_path), "--json", "--no-progress"]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] and report["mismatched_blocks"] == 0
    assert report["requests"] == 12 and set(report["tiers"]) == {"cpu", "disk"}
    assert any(tmp_path.rglob("*.kv"))  # write-through reached real files


def test_bundled_trace_is_the_generator_output() -> None:
    lines = [json.loads(line) for line in BUNDLED.read_text().splitlines()]
    assert lines == generate_demo_trace()
