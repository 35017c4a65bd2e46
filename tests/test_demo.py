"""``kvoffload demo`` end to end (small), and the bundled trace matches its generator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kvoffload.cli import main
from kvoffload.cli._demo_trace import generate_demo_trace
from kvoffload.cli.demo import render

BUNDLED = Path(__file__).resolve().parents[1] / "kvoffload" / "examples" / "demo_trace.jsonl"


DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
README = Path(__file__).resolve().parents[1] / "README.md"

#: The demo's figures on its bundled trace and layout, which decide them alone (no timing,
#: no randomness): docs/benchmarks.md shows this run and README's results table quotes it.
DEMO_FIGURES = {
    "requests": 110, "steps": 100, "prompt_tokens": 192740, "gpu_hit_tokens": 29184,
    "loaded_tokens": 69632, "cpu_hit_chunks": 607, "lower_hit_chunks": 1782,
    "verified_blocks": 4565, "mismatched_blocks": 0, "failed_load_tokens": 0,
    "failed_load_jobs": 0, "failed_stores": 0,
}  # fmt: skip


def _timeless(line: str) -> str:
    """A rendered line without its GB/s columns (a bare decimal not followed by a unit)."""
    words = [*line.split(), ""]
    bare = [re.fullmatch(r"\d+\.\d+", w) is not None for w in words]
    return " ".join(w for i, w in enumerate(words[:-1]) if not bare[i] or words[i + 1] == "MiB")


def test_demo_runs_verifies_and_reports_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default demo gives its known figures, and the ones the docs show are these."""
    code = main(["demo", "--disk-path", str(tmp_path), "--json", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] and set(report["tiers"]) == {"cpu", "disk"}
    assert {k: report[k] for k in DEMO_FIGURES} == DEMO_FIGURES
    assert any(tmp_path.rglob("*.kv"))  # write-through reached real files
    text = render(report).splitlines()
    assert text[0].startswith("kvoffload demo: 110 requests") and text[-1].startswith("OK: ")
    shown = [_timeless(line) for line in DOCS.read_text().splitlines()]
    for line in text[2:]:  # all but the title, which holds the run's seconds
        assert _timeless(line) in shown, f"docs/benchmarks.md does not show: {line}"
    readme = README.read_text()
    assert "4565 loaded blocks bit-exact, 0 mismatched; 36.1% of the prompt tokens" in readme
    assert "15.1% from the GPU cache" in readme


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
