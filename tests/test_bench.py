"""``kvoffload bench``: flags, the JSON rows, the table (sizes tiny; no timing asserted)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvoffload import ConfigError
from kvoffload.bench import BenchRow
from kvoffload.bench.local import bench_disk
from kvoffload.cli import bench

FIELDS = {"tier", "chunk_bytes", "store_gbps", "load_gbps", "ref_store_gbps", "ref_load_gbps"}


def run_cli(argv: list[str]) -> int:
    """Parse with only the bench subcommand registered, as ``kvoffload`` does."""
    parser = argparse.ArgumentParser(prog="kvoffload")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def test_json_rows_for_every_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--chunk-mib", "0.25", "--total-mib", "4", "--repeat", "1", "--json"]
    assert run_cli([*argv, "--disk-path", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list) and [row["tier"] for row in rows] == ["cpu", "disk"]
    for row in rows:
        assert row.keys() >= FIELDS
        assert row["chunk_bytes"] == 1 << 18
        assert all(row[f] > 0 for f in FIELDS - {"tier", "chunk_bytes"})
    cpu, disk = rows
    assert cpu["lookups_per_s"] is None and cpu["ref_lookups_per_s"] is None
    assert disk["lookups_per_s"] > 0 and disk["ref_lookups_per_s"] > 0  # probe vs os.stat
    assert list(tmp_path.iterdir()) == []  # the bench removes its scratch directory


def test_table_with_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--tier", "disk", "--chunk-mib", "0.25,0.5", "--total-mib", "1"]
    assert run_cli([*argv, "--repeat", "1", "--disk-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "ratio" in out[0] and "lookup/s" in out[0] and len(out) == 5
    assert out[2].startswith("disk") and "%" in out[2] and "0.25 MiB" in out[2]


def test_disk_row_knows_its_io_mode(tmp_path: Path) -> None:
    row = bench_disk(1 << 16, 1 << 18, str(tmp_path), repeat=1)
    assert isinstance(row, BenchRow) and row.tier == "disk"
    assert row.as_json()["direct_io"] is row.direct_io
    assert row.store_ratio > 0 and row.load_ratio > 0


def test_chunk_sizes_parse_to_whole_bytes() -> None:
    assert bench.parse_chunk_mib("0.25, 1,16") == [1 << 18, 1 << 20, 16 << 20]
    for bad in ("0", "-1", "abc", "0.0000001", ""):
        with pytest.raises(ConfigError, match="--chunk-mib"):
            bench.parse_chunk_mib(bad)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--chunk-mib", "4", "--total-mib", "1"], "--total-mib"),
        (["--tier", "disk", "--total-mib", "16", "--disk-path", "/nonexistent/x"], "--disk-path"),
    ],
)
def test_bad_flags_are_config_errors(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        run_cli(["bench", *argv])


def test_cpu_chunk_must_fit_the_synthetic_model() -> None:
    with pytest.raises(ConfigError, match="multiple of"):
        run_cli(["bench", "--tier", "cpu", "--chunk-mib", "0.0009765625", "--total-mib", "1"])


GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def run_gpu_check(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), *argv], capture_output=True, text=True, check=False
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the real check runs instead")
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    done = run_gpu_check()
    assert done.returncode == 0 and "skipped" in done.stdout


def test_gpu_check_dry_run_on_host_tensors(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = run_gpu_check("--device", "cpu", "--chunk-mib", "0.25", "--total-mib", "2",
                         "--repeat", "1", "--json-out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text(encoding="utf-8"))["rows"]
    paths = ("staged", "direct", "engine")
    assert [(r["layout"], r["block_ids"], r["path"]) for r in rows] == [
        (layout, ids, path)
        for layout in ("kv_first", "block_first")
        for ids in ("consecutive", "shuffled")
        for path in paths
    ]
    assert all(r["bit_exact"] and r["d2h_gbps"] > 0 and r["ref_h2d_gbps"] > 0 for r in rows)
