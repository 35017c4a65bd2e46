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
    assert "3      full     every token before H    128 KiB           16384 tokens" in out
    assert "0      sliding  the 64 tokens before H" in out


@pytest.mark.parametrize(
    ("args", "rows"),
    [
        (["tiny_deepseek_v4", "--dtype", "fp8_ds_mla"], [
            "0      sliding_mla     the 128 tokens before H  36.56 KiB ",
            "3      compressed_mla  every token before H     1.69 KiB..36.56 KiB (3 sizes)",
            "4      sliding_mla     the 8 tokens before H    8.44 KiB..32.06 KiB (2 sizes)",
        ]),
        (["tiny_qwen3_next", "--block-size", "128"], [
            "0      mamba  the state at H (one state)  35 KiB state (page 64 KiB)  16384 states",
            "3      full   every token before H        64 KiB                      4194304 tokens",
        ]),
        (["tiny_llama4", "--hybrid", "on"], [
            "0      chunked_local  tokens since H's 1024-token chunk",
            "3      full           every token before H",
        ]),
        (["tiny_llama4"], ["0      full  every token before H  8 KiB"]),
    ],
)  # fmt: skip
def test_plan_shows_what_each_kind_of_group_needs(
    args: list[str], rows: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    for row in rows:
        assert row in out, out


def test_plan_json_matches_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "tiny_gemma4", "--block-size", "128", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [g["tokens_per_block"] for g in plan["groups"]] == [2048, 2048, 2048, 128]
    assert plan["cpu_chunks_per_worker"] == (1 << 30) // 524288
    assert [(g["reuse"], g["window"]) for g in plan["groups"]] == [("window", 64)] * 3 + [
        ("prefix", None)
    ]


def test_plan_json_lists_each_layers_page_of_a_mixed_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "tiny_deepseek_v4", "--dtype", "fp8_ds_mla", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert groups[0]["page_bytes"] == 37440
    assert groups[3]["page_bytes"] == [8640, 37440, 1728, 8640, 37440, 1728]
    assert groups[3]["chunk_bytes"] == 2 * (8640 + 37440 + 1728)
    qwen = main(["plan", "tiny_qwen3_next", "--json"])
    state = json.loads(capsys.readouterr().out)["groups"][0]
    assert qwen == 0 and state["reuse"] == "state" and "cpu_states_if_alone" in state


@pytest.mark.parametrize(
    ("extra", "prefix"),
    [
        # Every chunk: 16384 chunks of the four groups' 256-token chunks (block raised to 256).
        ({"retention_interval": 1}, 16384 // 4 * 256),
        # 15649 full-attention chunks, and 3 states at each of 245 hit points (the end and
        # every 16384 tokens): 16384 chunks.
        ({}, 15649 * 256),
        # One hit point, at the end: 3 states.
        ({"retention_interval": 0}, (16384 - 3) * 256),
    ],
)
def test_plan_holds_a_longer_prefix_with_retention(
    extra: dict[str, int], prefix: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state group keeps one state per hit point, not one per chunk, of a shared prefix."""
    config = json.dumps({"cpu_bytes_to_use": "1GiB", **extra})
    args = ["plan", "tiny_qwen3_next", "--block-size", "128", "--extra-config", config]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_prefix_tokens"] == prefix


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
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("cpu_bytes_to_use", "blocks_per_chunk", "block_size", "disk_bytes_to_use"):
        assert key in out
