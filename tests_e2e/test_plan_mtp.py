"""``kvoffload plan MODEL --speculative-method mtp`` against the engine vLLM 0.32 starts.

Each engine starts with ``speculative_config={"method": "mtp", ...}`` and
dummy weights (the layout needs only the config) and serves no request
(``_kv_layout.py``): its KV cache groups, every layer's name and page, and
``num_prefill_lookahead_tokens`` are what ``plan`` must have predicted.

* DeepSeek-V3 (MLA): the MTP layers join the target's one group; the plan's
  layout is the one the connector reads from the engine (``group_map``), bytes,
  names and lookahead alike.
* Qwen3-Next: the MTP layers join the full-attention group and regroup the
  gated-DeltaNet layers. vLLM's CPU build raises the block size until a page
  holds a state and picks the SSM state's dtype by processor, neither of
  which ``plan --dtype`` models, so the groups, names, attention bytes per
  token and the state's elements (its conv rows grow with the drafted
  tokens) are compared, and the lookahead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _harness import MLA_FLOAT32_ENGINE
from _models_mtp import DEEPSEEK_V3_MTP, QWEN3_NEXT_MTP

from kvoffload.cli import main
from kvoffload.config.hf_drafter import with_mtp

HELPER = Path(__file__).with_name("_kv_layout.py")
ALIGN = {"enable_prefix_caching": True, "mamba_cache_mode": "align", "max_model_len": 4096}
MLA = MLA_FLOAT32_ENGINE


def engine_layout(tmp_path: Path, config: dict[str, Any], engine: dict[str, Any],
                  tokens: int) -> dict[str, Any]:  # fmt: skip
    """Start vLLM on ``config`` (dummy weights) with ``tokens`` MTP tokens; its layout."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    mtp = {"method": "mtp", "num_speculative_tokens": tokens}
    if "attention_config" in engine:  # the drafter's layers on the target's backend
        mtp["attention_backend"] = engine["attention_config"]["backend"]
    spec = {"model": str(model), "env": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")},
            "engine": {**engine, "load_format": "dummy", "speculative_config": mtp}}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "layout.json"
    ran = subprocess.run([sys.executable, str(HELPER), str(tmp_path / "spec.json"), str(out)],
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert ran.returncode == 0 and out.exists(), ran.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def plan_json(model: Path, tokens: int, capsys: pytest.CaptureFixture[str],
              *more: str) -> dict[str, Any]:  # fmt: skip
    argv = ["plan", str(model), "--speculative-method", "mtp", "--num-speculative-tokens",
            str(tokens), "--json", *more]  # fmt: skip
    assert main(argv) == 0
    plan: dict[str, Any] = json.loads(capsys.readouterr().out)
    return plan


@pytest.mark.parametrize(("modules", "tokens"), [(1, 1), (2, 2), (2, 1)])
def test_plan_of_a_deepseek_v3_mtp_is_the_engines_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], modules: int, tokens: int
) -> None:
    config = {**DEEPSEEK_V3_MTP, "num_nextn_predict_layers": modules}
    engine = engine_layout(tmp_path, config, MLA, tokens)
    assert engine["error"] is None, engine["error"]
    layout, _ = with_mtp(config, tokens, dtype="float32", block_size=16)
    assert engine["connector_layout"] == json.loads(json.dumps(dataclasses.asdict(layout)))
    assert layout.lookahead == engine["num_prefill_lookahead_tokens"] == (tokens if modules > 1
                                                                          else 1)  # fmt: skip
    plan = plan_json(tmp_path / "model", tokens, capsys, "--dtype", "float32")
    ((vllm_group,), (group,)) = (engine["groups"], plan["groups"])
    names = list(vllm_group["layers"])
    n = config["num_hidden_layers"]
    assert (
        group["drafter_layer_names"]
        == names[n:]
        == [f"model.layers.{n + i}.self_attn.attn" for i in range(modules)]
    )
    assert group["drafter_chunk_bytes"] == sum(vllm_group["layers"][name] for name in names[n:])
    assert group["chunk_bytes"] == sum(vllm_group["layers"].values())
    assert (plan["lookahead"], plan["num_speculative_tokens"]) == (layout.lookahead, tokens)


@pytest.mark.parametrize(("modules", "tokens"), [(1, 1), (2, 2)])
def test_plan_of_a_qwen3_next_mtp_has_the_engines_groups_names_and_states(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], modules: int, tokens: int
) -> None:
    config = {**QWEN3_NEXT_MTP, "num_nextn_predict_layers": modules}
    engine = engine_layout(tmp_path, config, ALIGN, tokens)
    assert engine["error"] is None, engine["error"]
    plan = plan_json(tmp_path / "model", tokens, capsys)
    layout, _ = with_mtp(config, tokens)
    kinds = {"MambaSpec": "mamba", "FullAttentionSpec": "full"}
    assert [(kinds[g["spec"]], list(g["layers"])) for g in engine["groups"]] == [
        (g.kind, list(g.layer_names)) for g in layout.groups
    ]
    for ours, theirs in zip(layout.groups, engine["groups"], strict=True):
        if ours.kind == "mamba":  # bfloat16 here: 2 bytes an element of conv and SSM state
            assert ours.page_bytes == 2 * sum(math.prod(s) for s in theirs["state_shapes"])
        else:
            per_token = {page // theirs["block_size"] for page in theirs["layers"].values()}
            assert per_token == {ours.page_bytes // ours.tokens_per_block}
    drafted = [name for g in plan["groups"] for name in g["drafter_layer_names"]]
    assert drafted == [f"mtp.layers.{i}.self_attn.attn" for i in range(modules)]
    assert plan["lookahead"] == engine["num_prefill_lookahead_tokens"] == tokens


def test_a_token_count_vllm_refuses_is_refused_by_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {**DEEPSEEK_V3_MTP, "num_nextn_predict_layers": 2}
    engine = engine_layout(tmp_path, config, MLA, 3)
    assert "must be divisible by n_predict=2" in engine["error"]
    argv = ["plan", str(tmp_path / "model"), "--speculative-method", "mtp",
            "--num-speculative-tokens", "3"]  # fmt: skip
    assert main(argv) == 2
    assert "--num-speculative-tokens 3 with 2 MTP modules" in capsys.readouterr().err
