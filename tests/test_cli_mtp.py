"""``kvoffload plan MODEL --speculative-method mtp``: the target's own MTP layers, where vLLM
0.32 puts them, with their bytes per chunk and the lookahead.

The expected layouts are what vLLM 0.32's CPU build formed for the same
configs (``tests_e2e/test_plan_mtp.py`` starts those engines and compares):
a DeepSeek-V3 MTP layer joins the MLA group as ``model.layers.{N}``; a
Qwen3-Next one is ``mtp.layers.0``, a full-attention layer that changes how
the gated-DeltaNet layers are grouped (3 + 1 layers: three state groups;
3 + 2: two, of 2 and 1), and every speculative token adds a row to each
conv state. The lookahead is vLLM's ``num_prefill_lookahead_tokens``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import assert_one_line, assert_plan_refuses, kvoffload

from kvoffload import cli
from kvoffload.cli.plan import example_path
from kvoffload.config._hf_mtp import mtp_layers
from kvoffload.config.hf_drafter import with_mtp
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.errors import ConfigError

#: DeepSeek-V3's MLA latent (512 + 64), two layers and one MTP layer.
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "num_nextn_predict_layers": 1}  # fmt: skip
QWEN3_NEXT = {**json.loads(example_path("tiny_qwen3_next").read_text()),
              "num_nextn_predict_layers": 1}  # fmt: skip


def _write(tmp_path: Path, name: str, config: dict[str, object]) -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return str(tmp_path / name)


def test_a_deepseek_mtp_layer_joins_the_mla_group_after_the_targets_layers() -> None:
    target = layout_from_hf_config(DEEPSEEK_V3)
    layout, mtp = with_mtp(DEEPSEEK_V3)
    (group,) = layout.groups
    assert group.kind == "mla" and group.replicated
    assert group.layer_names == (*target.layer_names, "model.layers.2.self_attn.attn")
    assert group.page_bytes == target.groups[0].page_bytes == 16 * 576 * 2
    assert (mtp.modules, mtp.num_speculative_tokens, layout.lookahead) == (1, 1, 1)


@pytest.mark.parametrize(
    ("modules", "tokens", "lookahead"),
    [(1, None, 1), (1, 3, 1), (2, None, 2), (2, 1, 1), (2, 4, 4), (3, 2, 2)],
)
def test_the_lookahead_is_the_drafted_tokens_when_several_modules_take_turns(
    modules: int, tokens: int | None, lookahead: int
) -> None:
    mtp = mtp_layers({**DEEPSEEK_V3, "num_nextn_predict_layers": modules}, tokens)
    assert list(mtp.layers) == [f"model.layers.{2 + i}.self_attn.attn" for i in range(modules)]
    assert mtp.lookahead == lookahead
    assert mtp.num_speculative_tokens == (modules if tokens is None else tokens)


def test_qwen3_next_mtp_layers_regroup_the_states_and_lengthen_them() -> None:
    alone = layout_from_hf_config(QWEN3_NEXT)
    assert [g.num_layers for g in alone.groups] == [1, 1, 1, 1]
    layout, _ = with_mtp(QWEN3_NEXT)
    assert [(g.kind, g.layer_names) for g in layout.groups] == [
        ("mamba", ("model.layers.0.linear_attn", "model.layers.2.linear_attn")),
        ("mamba", ("model.layers.1.linear_attn",)),
        ("full", ("model.layers.3.self_attn.attn", "mtp.layers.0.self_attn.attn")),
    ]
    conv_row = (2 * 64 * 2 + 64 * 4) * 2  # conv_dim in bfloat16: one row per draft token
    assert layout.groups[0].page_bytes == alone.groups[0].page_bytes + conv_row
    two, _ = with_mtp({**QWEN3_NEXT, "num_nextn_predict_layers": 2}, 2)
    assert [g.num_layers for g in two.groups] == [3, 3] and two.lookahead == 2
    assert two.groups[0].page_bytes == alone.groups[0].page_bytes + 2 * conv_row


def test_qwen3_5_mtp_is_its_mtp_num_hidden_layers() -> None:
    config = {**QWEN3_NEXT, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1}
    del config["num_nextn_predict_layers"]
    layout, mtp = with_mtp(config, 3)
    assert list(mtp.layers) == ["mtp.layers.0.self_attn.attn"] and layout.lookahead == 1
    with pytest.raises(ConfigError, match="count differently"):
        mtp_layers({**config, "mtp_num_hidden_layers": 2}, 2)


def test_plan_shows_the_mtp_layers_bytes_and_lookahead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _write(tmp_path, "ds", {**DEEPSEEK_V3, "num_nextn_predict_layers": 2})
    assert cli.main(["plan", model, "--speculative-method", "mtp", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["speculative_method"], plan["draft_model"]) == ("mtp", None)
    assert (plan["num_speculative_tokens"], plan["lookahead"]) == (2, 2)
    (group,) = plan["groups"]
    assert group["layers"] == 4 and group["drafter_layers"] == 2
    assert group["drafter_layer_names"] == [f"model.layers.{i}.self_attn.attn" for i in (2, 3)]
    assert group["drafter_chunk_bytes"] == 2 * 18432 and group["chunk_bytes"] == 4 * 18432
    argv = ["plan", model, "--speculative-method", "mtp", "--num-speculative-tokens", "1"]
    assert cli.main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "Drafter (mtp, the target's own MTP layers, 1 speculative token): 2 layers in group 0 "
        "(36 KiB of its 72 KiB chunk). Lookahead 1: its KV at a position reads the token after"
    ) in text


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--speculative-method", "mtp", "--draft-model", "DS"],
         "--speculative-method mtp takes no --draft-model"),
        (["--num-speculative-tokens", "2"], "--num-speculative-tokens needs a drafter"),
        (["--speculative-method", "mtp", "--num-speculative-tokens", "3", "--model", "DS2"],
         "--num-speculative-tokens 3 with 2 MTP modules"),
        (["--speculative-method", "mtp", "--model", "tiny_llama"],
         "not planned for model type 'llama'; it plans the MTP of deepseek_v3, qwen3_next"),
        (["--speculative-method", "mtp", "--model", "V2"],
         "model type 'deepseek_v2': vLLM maps no MTP architecture for DeepSeek-V2"),
        (["--speculative-method", "mtp", "--model", "tiny_deepseek_v4"],
         "DeepSeek-V4's MTP layers are compressed layers"),
        (["--speculative-method", "mtp", "--model", "tiny_qwen3_next"],
         "the 'qwen3_next' config has no MTP layers (num_nextn_predict_layers: None)"),
    ],
)  # fmt: skip
def test_plan_refuses_what_vllm_cannot_serve_as_mtp_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    two, v2 = {"num_nextn_predict_layers": 2}, {"model_type": "deepseek_v2"}
    models = {"DS": _write(tmp_path, "ds", DEEPSEEK_V3),
              "DS2": _write(tmp_path, "ds2", {**DEEPSEEK_V3, **two}),
              "V2": _write(tmp_path, "v2", {**DEEPSEEK_V3, **v2})}  # fmt: skip
    assert_plan_refuses(capsys, models["DS"], [models.get(a, a) for a in args], fragment)


def test_a_token_count_out_of_range_is_one_line() -> None:
    ran = kvoffload("plan", "tiny_llama", "--speculative-method", "mtp",
                    "--num-speculative-tokens", "0")  # fmt: skip
    assert_one_line(ran, "argument --num-speculative-tokens: 0 is out of range")
