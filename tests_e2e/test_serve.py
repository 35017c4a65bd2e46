"""The serving benchmark (``benchmarks/serve_chat.py``) on real `vllm serve` processes.

Tiny sizes: the 2-layer Llama, conversations of three turns whose history
outgrows an engine cache of 15 blocks. The benchmark's client talks to the
servers over HTTP, as any user's client would, and the figures asserted here
come from the servers' answers and their /metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _models import LLAMA, kv_bytes_per_token

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _serve import group_alive  # noqa: E402

#: One run of the script starts up to two servers one after the other (~1 min each here).
TIMEOUT_S = 3 * float(os.environ.get("KVOFFLOAD_E2E_TIMEOUT", "600"))
SCRIPT = ROOT / "benchmarks" / "serve_chat.py"
CONVERSATIONS, TURNS = 4, 3
# Every turn's history outgrows what the 15-block engine cache keeps of the others'.
TINY = [
    "--model", "llama", "--system-tokens", "128", "--user-tokens", "96",
    "--answer-tokens", "8", "--turns", str(TURNS), "--engine-blocks", "15",
]  # fmt: skip


def serve_chat(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def run_json(llama: str, tmp_path: Path, *argv: str) -> dict[str, Any]:
    model_dir = str(Path(llama).parent)  # the script builds (here: finds) <dir>/llama
    proc = serve_chat("--model-dir", model_dir, "--keep", str(tmp_path), "--json", *argv)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_kvoffload_answers_equal_an_engine_that_keeps_everything(
    llama: str, tmp_path: Path
) -> None:
    """float32, concurrency 1: the small engine cache plus kvoffload gives the oracle's tokens."""
    result = run_json(llama, tmp_path, "--workloads", "check", "--check-conversations", "4")
    check = result["check"]
    assert result["ok"]
    assert check["answers"] == CONVERSATIONS * TURNS
    assert check["identical"] == check["answers"]
    # The oracle's own cache served every full block of every history ...
    assert check["oracle_reused_all_history"]
    # ... and so did the small engine with kvoffload: its cached tokens are the oracle's,
    # which the 15-block engine cache could not have kept alone (the connector loaded them).
    assert check["kvoffload_cached_tokens"] == check["oracle_cached_tokens"]
    assert check["connector_hit_tokens"] > 0
    later_turns = [c for i, c in enumerate(check["kvoffload_cached_tokens"]) if i % TURNS]
    assert min(later_turns) > 128  # more than the system prompt: the conversation's history
    for server in check["servers"]:  # every server stopped, with its engine processes
        assert not group_alive(server["pgid"]), server
    cpus = sorted(os.sched_getaffinity(0))  # the two engines side by side, a core each
    expected = [f"[{cpus[0]}]", f"[{cpus[1 % len(cpus)]}]"]
    assert [s["engine_cores"] for s in check["servers"]] == expected


def test_timed_modes_report_hits_only_where_kvoffload_can_serve(llama: str, tmp_path: Path) -> None:
    """The timed path: vLLM alone, kvoffload and the limit (vLLM with room for every
    conversation, chat only), chat and unique prompts, concurrency 2."""
    result = run_json(
        llama, tmp_path, "--workloads", "chat,unique", "--conversations", str(CONVERSATIONS),
        "--unique-prompts", "3", "--unique-tokens", "300", "--dtype", "float32",
    )  # fmt: skip
    modes = result["modes"]
    assert set(modes) == {"vllm", "kvoffload", "limit"}
    limit = modes["limit"]["chat"]
    assert "unique" not in modes["limit"] and limit["connector_hit_tokens"] == 0
    # Its own cache kept every history: it computes less than vLLM alone with 15 blocks.
    assert limit["engine_hit_tokens"] > modes["vllm"]["chat"]["engine_hit_tokens"]
    against = result["against_limit"]
    assert set(against) == {"limit_speedup", "share_of_saving", "ttft_vs_limit"}
    for figures in modes.values():
        chat = figures["chat"]
        assert chat["requests"] == CONVERSATIONS * TURNS
        assert chat["generated_tokens"] == 8 * chat["requests"]
        assert len(chat["per_turn"]) == TURNS
        assert all(0 < t["ttft_median_s"] <= t["ttft_p90_s"] for t in chat["per_turn"])
        if "unique" in figures:
            assert figures["unique"]["requests"] == 3
            assert figures["unique"]["connector_hit_tokens"] == 0  # nothing to hit
        assert not group_alive(figures["server"]["pgid"])
        # The cores are pinned the same way in both modes (one reserved, as asked).
        assert figures["server"]["engine_cores"] == modes["vllm"]["server"]["engine_cores"]
    assert modes["vllm"]["chat"]["connector_hit_tokens"] == 0
    kv_chat, plain_chat = modes["kvoffload"]["chat"], modes["vllm"]["chat"]
    assert kv_chat["connector_hit_tokens"] > 0
    cached = [t["cached_tokens_median"] for t in kv_chat["per_turn"]]
    plain = [t["cached_tokens_median"] for t in plain_chat["per_turn"]]
    assert cached[-1] > plain[-1]  # the last turn's history came back from kvoffload


def test_sizes_an_engine_would_refuse_are_refused_before_any_server_starts(
    tmp_path: Path,
) -> None:
    proc = serve_chat("--workloads", "check", "--engine-blocks", "8", "--keep", str(tmp_path))
    assert proc.returncode != 0
    assert "--engine-blocks 8 cannot hold one request of 440 tokens" in proc.stderr
    assert "give --engine-blocks 15 or more" in proc.stderr
    assert not list(tmp_path.glob("*.log"))  # no server was started


def test_disk_modes_serve_histories_from_disk_either_way(llama: str, tmp_path: Path) -> None:
    """A CPU tier of 8 chunks keeps no history: each comes back from disk, loaded over later
    steps (``disk``) or promoted into the CPU tier first and loaded in its step
    (``disk-promote``); both serve the same tokens."""
    eight_chunks = str(8 * 32 * kv_bytes_per_token(LLAMA, dtype_bytes=4))
    result = run_json(
        llama, tmp_path, "--workloads", "chat", "--conversations", str(CONVERSATIONS),
        "--dtype", "float32", "--modes", "disk,disk-promote", "--disk-cpu-bytes", eight_chunks,
    )  # fmt: skip
    modes = {name: figures["chat"] for name, figures in result["modes"].items()}
    assert set(modes) == {"disk", "disk-promote"}
    for chat in modes.values():
        assert chat["requests"] == CONVERSATIONS * TURNS
        assert 0 < chat["disk_hit_tokens"] <= chat["connector_hit_tokens"]
    # The same histories either way, up to timing: what vLLM's own cache still holds when a
    # request is looked up, and a chunk the full 8-chunk CPU tier had no slot for before its
    # request ended (never stored: no_room_chunks), depend on when each step ran.
    served = [chat["engine_hit_tokens"] + chat["connector_hit_tokens"] for chat in modes.values()]
    assert abs(served[0] - served[1]) <= CONVERSATIONS * TURNS * 32, served
