"""``kvoffload demo`` end to end (small), and the bundled trace matches its generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_demo_on_gpu_kv_matches_the_host_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """KV tensors on the GPU: the same hits and loads as on the host, every block bit-exact."""
    reports = []
    for device in ("cpu", "cuda"):
        argv = ["demo", "--requests", "40", "--disk-path", str(tmp_path / device), "--json"]
        assert main([*argv, "--no-progress", "--device", device]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    host, gpu = reports
    assert gpu["ok"] and gpu["device"] == "cuda" and gpu["verified_blocks"] > 0
    for figure in ("gpu_hit_tokens", "loaded_tokens", "verified_blocks", "cpu_hit_chunks"):
        assert gpu[figure] == host[figure], figure


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_demo_on_a_missing_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cuda", "--no-progress"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-blocks", "0"], "--gpu-blocks: 0 is out of range: give a number from 1"),
        (["--requests", "-2"], "--requests: -2 is out of range: give a number from 1"),
        (["--device", "tpu"], "--device: invalid choice: 'tpu'"),
        (["--blocks-per-chunk", "0"], "--blocks-per-chunk: 0 is out of range"),
    ],
)
def test_bad_demo_flags_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
