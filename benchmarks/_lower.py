"""The serving benchmark's lower-tier modes: a small CPU tier, a disk behind it, a queue.

kvoffload with a CPU tier that holds about a quarter of the conversations'
histories (``--lower-cpu-share``) and a disk tier that holds all of them, the
client's concurrency above what the engine runs at once (``--max-num-seqs``),
so that requests wait in vLLM's queue and their histories come back from disk:

* ``lower``: ``fetch_while_queued`` false: a disk hit loads over later steps;
* ``lower-fetch``: true: a waiting request's disk chunks are read into the CPU
  tier while it waits, and its hit loads from host memory in its step;
* ``lower-slow`` and ``lower-slow-fetch``: the same two with a slow disk, the
  fault point ``load.slow_lower`` at the rate :func:`calibrate` sets.

**The slow disk.** These machines prefill slowly and read their disk fast,
the reverse of a GPU server. The slow disk gives a read of one token's KV on
this machine the same ratio to this machine's prefill of one token that an
NVMe read of a GPU model's KV has to that GPU's prefill (:data:`GPU_RATIO`):

* Llama-3.1-8B's KV: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
  (bf16) = 131,072 bytes a token (its ``config.json``);
* one PCIe 4.0 NVMe drive reads 6.9 GB/s sequentially (Kioxia CM6's data
  sheet figure), so a token's KV takes 19.0 us (one drive a GPU, as a DGX H100
  has eight data drives for its eight GPUs);
* an H100 SXM prefills Llama-3.1-8B at 55,200 prompt tokens/s or more:
  TensorRT-LLM's performance overview measures 3,450 output tokens/s at
  2,048 input and 128 output tokens a request (FP8, TP1), so 16 prompt tokens
  went through for each output token, and the decode steps took some of that
  time too: 18.1 us a token at most
  (https://nvidia.github.io/TensorRT-LLM/performance/perf-overview.html).

So a token's KV read from NVMe takes about 1.05x its prefill on an H100. Here
the prefill of a token is measured on the first server of the run (the time
to first token of a prompt nobody has asked before, at concurrency 1, over
its tokens), and the disk is slowed to ``kv_bytes_per_token / (1.05 x that)``.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _chat import unique_prompts
from _serve import Server, complete

LOWER_MODES = ("lower", "lower-fetch", "lower-slow", "lower-slow-fetch")
SLOW_MODES = ("lower-slow", "lower-slow-fetch")

#: Llama-3.1-8B's KV bytes a token in bf16: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2.
GPU_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
#: Sequential read of one PCIe 4.0 NVMe drive (Kioxia CM6: up to 6.9 GB/s).
NVME_READ_BYTES_PER_S = 6.9e9
#: H100 SXM prefill of Llama-3.1-8B, at least: TensorRT-LLM's 3,450 output tokens/s at
#: 2,048 input / 128 output tokens a request (FP8, TP1), times 2,048 / 128.
H100_PREFILL_TOKENS_PER_S = 3450 * 2048 / 128
#: Read time of a token's KV over its prefill time on that server (about 1.05).
GPU_RATIO = GPU_KV_BYTES_PER_TOKEN / NVME_READ_BYTES_PER_S * H100_PREFILL_TOKENS_PER_S

#: vLLM logs the connector's figures each interval (``KV Transfer metrics: ...``); the
#: lower modes ask for one a second, so that the fault point's count of the last steps
#: is logged before the server stops.
LOG_INTERVAL_S = 1.0
FIRED = re.compile(r"KV Transfer metrics: .*?\bfailpoint_load_slow_lower=(\d+)")

#: The kvoffload series the lower-tier table reads from /metrics, by (name, tier label).
SERIES = {
    "hit_tokens_cpu": ("vllm:kvoffload_hit_tokens_total", "cpu"),
    "hit_tokens_disk": ("vllm:kvoffload_hit_tokens_total", "disk"),
    "loaded_tokens_cpu": ("vllm:kvoffload_loaded_tokens_total", "cpu"),
    "loaded_tokens_disk": ("vllm:kvoffload_loaded_tokens_total", "disk"),
    "loaded_bytes_disk": ("vllm:kvoffload_loaded_bytes_total", "disk"),
    "in_step_hit_tokens": ("vllm:kvoffload_in_step_hit_tokens_total", ""),
    "queued_holds": ("vllm:kvoffload_queued_holds_total", ""),
    "queued_fetches": ("vllm:kvoffload_queued_fetches_total", ""),
    "queued_fetched_chunks": ("vllm:kvoffload_queued_fetched_chunks_total", ""),
    "failed_loads_disk": ("vllm:kvoffload_failed_loads_total", "disk"),
    "lookup_miss_tokens": ("vllm:kvoffload_lookup_miss_tokens_total", ""),
}


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "float") else 2


def cpu_tier_bytes(
    conversations: int, share: float, chat_len: int, system_tokens: int, *, chunk_bytes: int,
    chunk_tokens: int,
) -> int:  # fmt: skip
    """A CPU tier for the shared system prompt and ``share`` of the conversations' own
    tokens (all their turns), in whole chunks."""
    tokens = system_tokens + share * conversations * (chat_len - system_tokens)
    return math.ceil(tokens / chunk_tokens) * chunk_bytes


def connector(
    base: dict[str, Any], cpu_bytes: int, disk: Path, mode: str, queued_share: float
) -> dict[str, Any]:
    """The lower mode's kv_connector_extra_config; its disk directory starts empty."""
    shutil.rmtree(disk, ignore_errors=True)  # a kept work directory holds an older run's
    return {**base, "cpu_bytes_to_use": cpu_bytes, "disk_path": str(disk),
            "disk_bytes_to_use": "8GiB", "queued_cpu_share": queued_share,
            "fetch_while_queued": mode.endswith("-fetch")}  # fmt: skip


def environment(mode: str, rate: float | None) -> tuple[tuple[str, str], ...]:
    """The lower mode's server environment: a log line a second, the slow disk's fault."""
    env = [("VLLM_LOG_STATS_INTERVAL", str(LOG_INTERVAL_S))]
    if mode in SLOW_MODES and rate is not None:
        env.append(("KVOFFLOAD_FAILPOINTS", f"load.slow_lower={max(1, round(rate))}B/s"))
    return tuple(env)


@dataclass
class Calibration:
    """This machine's prefill of one token, and the slow disk's rate it gives."""

    prompt_tokens: int = 0
    seconds_per_token: float = 0.0
    rate: float | None = None  # bytes a second; None until measured (or given)
    given: bool = False

    def record(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_s_per_token": self.seconds_per_token,
            "gpu_ratio": GPU_RATIO,
            "slow_read_bytes_per_s": self.rate,
            "rate_given": self.given,
        }


def calibrate(
    cal: Calibration, server: Server, tokens: int, vocab: int, *, ratio: float, kv_per_token: int
) -> None:
    """Time to first token of two fresh ``tokens``-token prompts, one at a time: the
    faster, over its tokens, is this machine's prefill of a token."""
    ttfts = [
        complete(server.port, conv.questions[0], 1, 1800.0).ttft_s
        for conv in unique_prompts(2, tokens, vocab, seed=3)
    ]
    cal.prompt_tokens, cal.seconds_per_token = tokens, min(ttfts) / tokens
    cal.rate = kv_per_token / (ratio * cal.seconds_per_token)


def counters(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, int]:
    """The :data:`SERIES` over a workload: deltas of the server's /metrics."""
    return {name: int(after.get(k, 0) - before.get(k, 0)) for name, k in SERIES.items()}


def fired(server: Server) -> int:
    """Chunks ``load.slow_lower`` delayed, from the server's log lines (after the last
    interval's line had its second to come)."""
    time.sleep(2 * LOG_INTERVAL_S + 0.5)
    return sum(int(m.group(1)) for m in FIRED.finditer(server.log.read_text(errors="replace")))


def later_turns(row: dict[str, Any]) -> float:
    return float(row["later_turns"]["ttft_median_s"])


def header(setup: dict[str, Any]) -> list[str]:
    """What the lower modes ran on: the tiers, the queue, the slow disk."""
    lines = [
        f"\nlower tier: a CPU tier of {setup['lower_cpu_bytes'] / 2**20:.1f} MiB (the system "
        f"prompt and {setup['lower_cpu_share']:.0%} of the conversations' own tokens), a disk "
        f"tier for all; concurrency {setup['concurrency']}, max-num-seqs "
        f"{setup['max_num_seqs']}; queued_cpu_share {setup['lower_queued_share']}"
    ]
    cal = setup.get("calibration")
    if cal:
        how = "as given"
        if not cal["rate_given"]:
            how = (
                f"{cal['gpu_ratio']:.2f}x this machine's prefill of "
                f"{1000 * cal['prefill_s_per_token']:.3f} ms a token (a "
                f"{cal['prompt_tokens']}-token prompt): an NVMe read of Llama-3.1-8B's KV "
                "against an H100's prefill"
            )
        rate = cal["slow_read_bytes_per_s"] / 1e6
        lines.append(f"slow disk: load.slow_lower={rate:.2f}MB/s, {how}")
    return lines


def table(modes: dict[str, dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    """The lower-tier table: each mode against vLLM alone and the limit, in lines."""
    alone, limit = (modes.get(m, {}).get("chat") for m in ("vllm", "limit"))
    lines = [
        *header(setup),
        f"{'mode':<17} {'total s':>8} {'saving':>7}  {'TTFT turns 2+ median / p90':>27} "
        f"{'x limit':>8}  {'hits cpu / disk':>17} {'loaded cpu / disk':>19} "
        f"{'in step':>8} {'fetches / chunks':>17} {'disk reads / slowed':>20}",
    ]
    for name in ("vllm", "limit", *LOWER_MODES):
        row = modes.get(name, {}).get("chat")
        if row is None:
            continue
        saving, vs = "", ""
        if alone and limit and alone["seconds"] != limit["seconds"]:
            gain = (alone["seconds"] - row["seconds"]) / (alone["seconds"] - limit["seconds"])
            saving = f"{gain + 0.0:.0%}"  # not -0%
        if limit:
            vs = f"{later_turns(row) / later_turns(limit):.2f}x"
        k = row.get("kvoffload")
        cells = ["", "", "", "", ""]
        if k is not None:
            cells = [
                f"{k['hit_tokens_cpu']} / {k['hit_tokens_disk']}",
                f"{k['loaded_tokens_cpu']} / {k['loaded_tokens_disk']}",
                str(k["in_step_hit_tokens"]),
                f"{k['queued_fetches']} / {k['queued_fetched_chunks']}",
                f"{k['loaded_bytes_disk'] // setup['lower_chunk_bytes']} / "
                f"{k.get('slowed_chunks', '-')}",
            ]
        late = row["later_turns"]
        lines.append(
            f"{name:<17} {row['seconds']:>8.1f} {saving:>7}  "
            f"{late['ttft_median_s']:>13.2f} /{late['ttft_p90_s']:>6.2f}       {vs:>8}  "
            f"{cells[0]:>17} {cells[1]:>19} {cells[2]:>8} {cells[3]:>17} {cells[4]:>20}"
        )
    lines.append(
        "saving: (vllm - mode) / (vllm - limit) of the total time; turns 2+: every turn with "
        "a history (in the lower modes a lower-tier hit by construction: it waited behind the "
        "other conversations' turns, which filled the CPU tier); tokens by the tier a hit's "
        "chunks were in when it arrived, and chunks, from /metrics; 'in step': hit tokens "
        "loaded from the CPU tier in the step that scheduled them; 'slowed': chunks the slow "
        "disk delayed (load.slow_lower), from the server's log"
    )
    return lines
