"""``kvoffload demo`` end to end (small), and the bundled trace matches its generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.cli._demo_trace import generate_demo_trace
from kvoffload.cli.demo import render

BUNDLED = Path(__file__).resolve().parents[1] / "kvoffload" / "examples" / "demo_trace.jsonl"


def test_demo_runs_verifies_and_reports_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["demo", "--requests", "24", "--disk-path", str(tmp_path), "--json", "--no-progress"]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] and report["mismatched_blocks"] == 0
    assert report["requests"] == 24 and set(report["tiers"]) == {"cpu", "disk"}
    # The connector loaded shared prompts and earlier turns, and every block it filled
    # was checked; the GPU cache served some prompts itself.
    assert report["loaded_tokens"] > 0 and report["verified_blocks"] > 0
    assert report["gpu_hit_tokens"] > 0 and report["failed_stores"] == 0
    assert report["gpu_hit_tokens"] + report["loaded_tokens"] < report["prompt_tokens"]
    assert any(tmp_path.rglob("*.kv"))  # write-through reached real files
    text = render(report).splitlines()
    assert text[0].startswith("kvoffload demo: 24 requests") and text[-1].startswith("OK: ")
    loaded = next(line for line in text if "loaded by kvoffload" in line).split()
    assert int(loaded[3]) == report["loaded_tokens"]


def test_bundled_trace_is_the_generator_output() -> None:
    lines = [json.loads(line) for line in BUNDLED.read_text().splitlines()]
    assert lines == generate_demo_trace()
