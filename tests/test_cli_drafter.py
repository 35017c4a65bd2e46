"""A speculative drafter on the command line: ``plan --speculative-method``, ``demo`` and
``replay --drafter``.

An EAGLE head's layers join the target's full-attention group under the
target's own names (``model.layers.{N + i}.self_attn.attn``) and its KV reads
the token after each position, so the layout gets a lookahead of 1: ``plan``
says so and shows what the drafter adds to a chunk; the demo and the replay
run the stand-in with one drafter layer, the demo checking every load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import assert_plan_refuses

from kvoffload import cli
from kvoffload.cli.plan import example_path
from kvoffload.config.hf_drafter import DRAFT_PREFIX, with_drafter_layer, with_eagle_head
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.errors import ConfigError
from kvoffload.replay.engine import trace_layout

LLAMA = json.loads(example_path("tiny_llama").read_text())
HEAD = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "hidden_size": 64,
        "architectures": ["LlamaForCausalLMEagle3"]}  # fmt: skip


@pytest.fixture
def head(tmp_path: Path) -> Path:
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text(json.dumps(HEAD))
    return tmp_path / "head"


def test_an_eagle_head_joins_the_full_group_under_vllms_names_with_a_lookahead() -> None:
    target = layout_from_hf_config(LLAMA, block_size=16)
    layout = with_eagle_head(target, LLAMA, HEAD, block_size=16)
    (group,) = layout.groups
    n = LLAMA["num_hidden_layers"]
    assert group.layer_names == (*target.layer_names, f"model.layers.{n}.self_attn.attn")
    assert layout.lookahead == 1 and target.lookahead == 0
    assert group.layer_pages == (*target.groups[0].layer_pages, 16 * 2 * 2 * 32 * 2)


def test_plan_shows_the_heads_layers_bytes_and_lookahead(
    head: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for method in ("eagle", "eagle3"):
        assert cli.main(["plan", "tiny_llama", "--draft-model", str(head),
                         "--speculative-method", method, "--json"]) == 0  # fmt: skip
        plan = json.loads(capsys.readouterr().out)
        assert (plan["speculative_method"], plan["lookahead"]) == (method, 1)
        (group,) = plan["groups"]
        assert group["drafter_layers"] == 1 and group["layers"] == 3
        assert group["drafter_chunk_bytes"] == 4096 and group["chunk_bytes"] == 3 * 4096
    assert cli.main(["plan", "tiny_llama", "--draft-model", str(head),
                     "--speculative-method", "eagle"]) == 0  # fmt: skip
    text = " ".join(capsys.readouterr().out.split())
    assert "Drafter (eagle, " in text and "1 layer in group 0 (4 KiB of its 12 KiB chunk)" in text
    assert "Lookahead 1: its KV at a position reads the token after it" in text


def test_plan_without_a_method_is_a_draft_model_and_without_a_drafter_none(
    head: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", "tiny_llama", "--draft-model", str(head), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["speculative_method"], plan["lookahead"]) == ("draft_model", 0)
    assert plan["groups"][0]["drafter_layers"] == 1
    assert cli.main(["plan", "tiny_llama", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["speculative_method"], plan["draft_model"], plan["lookahead"]) == (None, None, 0)
    assert "drafter_layers" not in plan["groups"][0]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--speculative-method", "eagle"], "--speculative-method eagle needs --draft-model"),
        (["--speculative-method", "draft_model"], "needs --draft-model"),
        (["--speculative-method", "mtp"], "mtp is not planned for model type 'llama'"),
        (["--speculative-method", "mtp", "--draft-model", "HEAD"], "mtp takes no --draft-model"),
        (["--speculative-method", "eagle", "--draft-model", "HEAD", "--block-size", "32",
          "--model", "tiny_gemma4"], "an EAGLE head beside a hybrid target"),
    ],
)  # fmt: skip
def test_plan_refuses_bad_drafter_combinations_in_one_line(
    head: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    assert_plan_refuses(capsys, "tiny_llama", [str(head) if a == "HEAD" else a for a in args],
                        fragment)  # fmt: skip


def test_the_demo_and_replay_drafter_is_one_layer_of_a_target_page() -> None:
    layout = trace_layout()
    assert with_drafter_layer(layout, "none") is layout
    eagle = with_drafter_layer(layout, "eagle")
    assert (
        eagle.lookahead == 1 and eagle.groups[0].layer_names[1] == "model.layers.1.self_attn.attn"
    )
    draft = with_drafter_layer(layout, "draft_model")
    assert draft.lookahead == 0 and draft.groups[0].layer_names[1].startswith(DRAFT_PREFIX)
    assert draft.groups[0].layer_pages == eagle.groups[0].layer_pages == (1024, 1024)
    gemma = layout_from_hf_config(example_path("tiny_gemma4"), block_size=16)
    with_head = with_drafter_layer(gemma, "eagle")
    assert [g.num_layers for g in with_head.groups][-1] == gemma.groups[-1].num_layers + 1
    sliding = trace_layout().groups[0].__class__("sliding", 16, ("s",), 32, sliding_window=32)
    with pytest.raises(ConfigError, match="no full-attention group"):
        with_drafter_layer(type(layout)((sliding,)), "eagle")


@pytest.mark.parametrize("drafter", ["eagle", "draft_model"])
def test_the_demo_runs_with_a_drafter_and_verifies_every_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], drafter: str
) -> None:
    code = cli.main(["demo", "--requests", "40", "--disk-path", str(tmp_path), "--json",
                     "--no-progress", "--drafter", drafter])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] and report["drafter"] == drafter
    assert report["lookahead"] == (1 if drafter == "eagle" else 0)
    assert report["loaded_tokens"] > 0 and report["verified_blocks"] > 0
    assert report["mismatched_blocks"] == 0 and report["failed_stores"] == 0


def write_lengths(path: Path, requests: list[list[int]]) -> Path:
    lines = [json.dumps({"timestamp": i, "input_length": 512 * len(ids), "hash_ids": ids})
             for i, ids in enumerate(requests)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_replay_runs_a_drafter_in_the_engine_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt that ends on a block boundary leaves its last block unkeyed with an EAGLE head:
    no token after it names its KV; the next turn hits only the block before."""
    trace = write_lengths(tmp_path / "t.jsonl", [[1, 2], [1, 2, 3]])
    base = ["replay", str(trace), "--capacity", "10", "--policy", "lru", "--json"]
    hits = {}
    for drafter in ("none", "draft_model", "eagle"):
        assert cli.main([*base, "--drafter", drafter]) == 0
        [row] = json.loads(capsys.readouterr().out)
        hits[drafter] = row["gpu_hit_tokens"] + row["loaded_tokens"]
    assert hits == {"none": 1024, "draft_model": 1024, "eagle": 512}
    assert cli.main([*base[:-1], "--drafter", "eagle"]) == 0
    assert "drafter: eagle (lookahead 1)" in capsys.readouterr().out.splitlines()[0]
    assert cli.main([*base, "--index-only", "--drafter", "eagle"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--drafter eagle needs the engine replay" in err


def test_a_drafters_pages_are_one_ranks_as_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM runs the drafter at the target's tensor parallelism: its KV heads split too."""
    for method in ("draft_model", "eagle"):
        assert cli.main(["plan", "tiny_llama", "--world-size", "2", "--draft-model", "tiny_llama",
                         "--speculative-method", method, "--json"]) == 0  # fmt: skip
        (group,) = json.loads(capsys.readouterr().out)["groups"]
        assert group["page_bytes"] == 2048 and group["drafter_chunk_bytes"] == 2 * 2048


@pytest.mark.parametrize(
    ("args", "resolved"),
    [
        (["tiny_llama"], {"key_source": "engine", "load_in_step": "in_step"}),
        (["tiny_gemma4", "--block-size", "32"], {"key_source": "engine",
                                                 "load_in_step": "next_step"}),
        (["tiny_qwen3_next"], {"key_source": "engine", "load_in_step": "next_step"}),
        (["tiny_llama", "--speculative-method", "eagle"], {"key_source": "tokens",
                                                          "load_in_step": "in_step"}),
        (["tiny_llama", "--extra-config", '{"key_source": "tokens", "load_in_step": "never",'
          ' "cpu_bytes_to_use": "1GiB"}'], {}),
    ],
)  # fmt: skip
def test_plan_says_what_auto_becomes_as_the_engine_resolves_it(
    head: Path, capsys: pytest.CaptureFixture[str], args: list[str], resolved: dict[str, str]
) -> None:
    """The connector's own rules, asked by plan: engine keys unless a drafter reads past a
    chunk; CPU-tier hits in the step on one group keeping the whole prefix, without a state."""
    if "--speculative-method" in args:
        args = [*args, "--draft-model", str(head)]
    assert cli.main(["plan", *args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resolved"] == resolved
    assert cli.main(["plan", *args]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "(auto)" in line]
    assert [line.split()[0] for line in lines] == list(resolved)
    for line, choice in zip(lines, resolved.values(), strict=True):
        assert f"{choice} here: " in line
