"""`kvoffload plan`: tables, JSON, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.cli import main


def test_plan_prints_groups_and_budget(capsys: pytest.CaptureFixture[str]) -> None:
    extra = json.dumps({"blocks_per_chunk": 2, "cpu_bytes_to_use": "64MiB"})
    code = main(["plan", "tiny_gemma4", "--block-size", "32", "--extra-config", extra])
    out = capsys.readouterr().out
    assert code == 0
    assert "256 chunks per worker" in out
    assert "1024" in out  # sliding tokens per chunk: 512 * 2
    assert "group 3 (full): 16384 tokens" in out


def test_plan_json_matches_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "tiny_gemma4", "--block-size", "128", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [g["tokens_per_block"] for g in plan["groups"]] == [2048, 2048, 2048, 128]
    assert plan["cpu_chunks_per_worker"] == (1 << 30) // 524288


def test_plan_reads_extra_config_from_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"cpu_bytes_to_use": "1MiB", "blocks_per_chunk": "4"}))
    assert main(["plan", "tiny_llama", "--extra-config", f"@{extra}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["blocks_per_chunk"] == 4


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ('{"blocks_per_chunk": 0, "cpu_bytes_to_use": "1GiB"}', "must be greater than 0"),
        ('{"block_size": 32, "cpu_bytes_to_use": "1GiB"}', "use 'blocks_per_chunk' instead"),
        ('{"blocks_per_chunk": 1e306, "cpu_bytes_to_use": "1GiB"}', "at most 1,048,576"),
        ('{"cpu_bytes_to_use": 1' + "0" * 5000 + "}", "not valid JSON"),
        ("{oops", "not valid JSON"),
        ("@/nonexistent.json", "cannot read --extra-config"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_2(extra: str, fragment: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvoffload", "plan", "tiny_gemma4", "--extra-config", extra],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plan_help_lists_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for key in ("cpu_bytes_to_use", "blocks_per_chunk", "block_size", "disk_bytes_to_use"):
        assert key in out
