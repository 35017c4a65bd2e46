"""The connector replay against vLLM's own ``OffloadingConnector``, run, not remembered.

``benchmarks/replay_vs_vllm.py`` drives vLLM 0.32's ``OffloadingConnector``
scheduler side and kvoffload's connector through the same stand-in engine.
With the same policy (LRU) and the same budget the two must load exactly the
same tokens: a difference means the stand-in, the hit rules or the usage order
drifted from vLLM's. The unit suite keeps the figures vLLM gave on this slice;
this test recomputes them from vLLM itself. With its default policy kvoffload
must never load fewer tokens than vLLM's connector, whatever the CPU tier's size.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvoffload.replay import load_trace
from kvoffload.replay.engine import EngineSettings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from replay_vs_vllm import kvoffload_row, vllm_row  # noqa: E402

SLICE = ROOT / "tests" / "data" / "mooncake_conversation_3000.jsonl"


def test_lru_through_kvoffload_loads_what_vllms_connector_loads() -> None:
    trace = load_trace(SLICE, limit=1000)
    settings = EngineSettings(gpu_blocks=300)
    ours = kvoffload_row(trace, 1000, "lru", settings)
    theirs = vllm_row(trace, 1000, "lru", settings)
    assert theirs.loaded_tokens > 0, "the slice must exercise the CPU tier"
    assert (ours.steps, ours.prompt_tokens) == (theirs.steps, theirs.prompt_tokens)
    assert (ours.gpu_hit_tokens, ours.loaded_tokens) == (
        theirs.gpu_hit_tokens,
        theirs.loaded_tokens,
    )


def test_the_default_policy_never_loads_less_than_vllms_connector() -> None:
    # The bar, on the slice: small (the admission filter), in between (the protected
    # segment) and large (plain LRU) CPU tiers, against vLLM's own connector with its LRU.
    trace = load_trace(SLICE)
    settings = EngineSettings(gpu_blocks=300)
    for capacity in (1000, 6000, 16000):
        ours = kvoffload_row(trace, capacity, "adaptive", settings, transfers=False)
        theirs = vllm_row(trace, capacity, "lru", settings)
        assert ours.gpu_hit_tokens == theirs.gpu_hit_tokens  # the same engine in front
        assert ours.loaded_tokens >= theirs.loaded_tokens > 0, capacity
