"""The command line as a newcomer meets it: the real ``kvoffload`` in a child process.

Every refusal is one line on stderr and exit 2, every warning one line, and
nothing ever ends in a traceback: not a closed pipe, not an absurd flag, not a
model or trace that makes no sense.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import assert_one_line, kvoffload, kvoffload_all

import kvoffload as package
from kvoffload import ConfigError, IgnoredKeysWarning, build_offloading_config
from kvoffload.cli.plan import example_path
from kvoffload.config.hf_layout import layout_from_hf_config

TRACE = Path(__file__).resolve().parents[1] / "kvoffload" / "examples" / "demo_trace.jsonl"


def test_version_names_the_package() -> None:
    ran = kvoffload("--version")
    assert ran.code == 0 and ran.out.strip() == f"kvoffload {package.__version__}"


@pytest.mark.parametrize("argv", [["plan", "tiny_llama"], ["plan", "tiny_gemma4", "--json"]])
def test_a_closed_pipe_ends_quietly(argv: list[str]) -> None:
    """``kvoffload plan ... | head`` with the reader gone before the first write."""
    child = subprocess.Popen(
        [sys.executable, "-m", "kvoffload", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # the only reader: every write of the child now fails with EPIPE
    with child.stderr:
        err = child.stderr.read()
    assert child.wait(timeout=300) == 0
    assert err == ""


def test_every_flag_is_bounded_before_any_work(tmp_path: Path) -> None:
    """Numbers that once ended in MemoryError or a refused allocation: one line each."""
    cases = [
        (["replay", TRACE, "--capacity", "10000000000000"], "--capacity: '10000000000000'"),
        (["replay", TRACE, "--capacity", "10000000000000", "--index-only"], "--capacity"),
        (["replay", TRACE, "--gpu-blocks", "10000000000"], "argument --gpu-blocks"),
        (["replay", TRACE, "--step-tokens", "-5"], "argument --step-tokens"),
        (["replay", TRACE, "--limit", "0"], "argument --limit: 0 is out of range"),
        (["bench", "--total-mib", "1e9"], "argument --total-mib: 1e9 is out of range"),
        (["bench", "--total-mib", "nan"], "argument --total-mib"),
        (["bench", "--repeat", "0"], "argument --repeat"),
        (["bench", "--chunk-mib", "100000", "--total-mib", "60000"], "--chunk-mib"),
        (["demo", "--gpu-blocks", "100000000"], "argument --gpu-blocks"),
        (["demo", "--cpu-bytes", "1EiB"], "more than this machine's"),
        (["plan", "tiny_llama", "--block-size", "100000000000"], "argument --block-size"),
        (["plan", "tiny_llama", "--world-size", "0"], "argument --world-size"),
        (["plan", "tiny_llama", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ]
    for ran, (argv, fragment) in zip(kvoffload_all([a for a, _ in cases]), cases, strict=True):
        assert_one_line(ran, fragment)
        assert ran.out == "", argv  # refused before any work: nothing measured or replayed


def test_block_size_flag_is_named_as_the_flag() -> None:
    """Not as the extra-config key ``block_size`` (tokens per chunk), nor as a budget."""
    zero, absurd = kvoffload_all(
        [
            ["plan", "tiny_llama", "--block-size", "0"],
            ["plan", "tiny_llama", "--block-size", "1e12"],
        ]
    )
    assert_one_line(zero, "argument --block-size: 0 is out of range")
    assert_one_line(absurd, "argument --block-size: '1e12' is not a whole number")


def test_an_ignored_vllm_key_is_one_plain_warning_line() -> None:
    extra = json.dumps({"cpu_bytes_to_use": "1GiB", "spec_name": "x"})
    ran = kvoffload("plan", "tiny_llama", "--extra-config", extra)
    assert ran.code == 0 and "0      full" in ran.out
    assert_one_line(ran, "ignores these keys of vLLM's OffloadingConnector: spec_name",
                    code=0, kind="warning")  # fmt: skip
    assert "IgnoredKeysWarning" not in ran.err and ".py:" not in ran.err


def test_plan_and_demo_say_which_directories_they_create(tmp_path: Path) -> None:
    # Each its own tree: run at once, the demo would create the plan's before it looked.
    planned, served = tmp_path / "p" / "kv", tmp_path / "d" / "kv"
    extra = json.dumps(
        {"cpu_bytes_to_use": "1GiB", "disk_path": str(planned), "disk_bytes_to_use": "1GiB"}
    )
    plan, demo = kvoffload_all([
        ["plan", "tiny_llama", "--extra-config", extra],
        ["demo", "--requests", "2", "--disk-path", served],
    ])  # fmt: skip
    for ran, target in ((plan, planned), (demo, served)):
        assert_one_line(ran, f"creates {target.parent}, {target} (mode 0700)", code=0,
                        kind="warning")  # fmt: skip
    assert served.is_dir() and not planned.exists()  # the demo created its own, as an engine
    # would; plan only said so


def test_a_disk_budget_past_the_free_space_is_named() -> None:
    extra = json.dumps(
        {"cpu_bytes_to_use": "1GiB", "disk_path": "/tmp", "disk_bytes_to_use": "1EiB"}
    )
    ran = kvoffload("plan", "tiny_llama", "--extra-config", extra)
    assert_one_line(ran, "disk_bytes_to_use 1 EiB is more than the ", code=0, kind="warning")
    assert " free on the file system of '/tmp'" in ran.err


def _config(tmp_path: Path, name: str, config: dict[str, object]) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def test_architectures_encoders_refused_unknown_ones_warned(tmp_path: Path) -> None:
    t5 = {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "is_encoder_decoder": True,
        "num_layers": 6,
        "d_model": 512,
    }
    bert = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
    }
    invented = {"architectures": ["FooForCausalLM"], "model_type": "foo", "hidden_size": 256,
                "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    ran_t5, ran_bert, ran_foo = kvoffload_all(
        [["plan", _config(tmp_path, name, config)]
         for name, config in (("t5", t5), ("bert", bert), ("foo", invented))]
    )  # fmt: skip
    assert_one_line(ran_t5, "T5 is an encoder-decoder model ('t5' ('T5ForConditionalGeneration'))")
    assert_one_line(ran_bert, "BERT is an encoder-only model")
    assert_one_line(ran_foo, "model type 'foo' ('FooForCausalLM') is not one kvoffload knows",
                    code=0, kind="warning")  # fmt: skip


def test_messages_that_once_misled() -> None:
    exbi, zebi, ds_mla = kvoffload_all([
        ["plan", "tiny_llama", "--extra-config", '{"cpu_bytes_to_use": "1EiB"}', "--json"],
        ["plan", "tiny_llama", "--extra-config", '{"cpu_bytes_to_use": "1ZiB"}'],
        ["plan", "tiny_llama", "--dtype", "fp8_ds_mla"],
    ])  # fmt: skip
    assert exbi.code == 0 and json.loads(exbi.out)["cpu_bytes_to_use"] == 2**60
    assert_one_line(zebi, "units: B, KiB, MiB, GiB, TiB, PiB, EiB (powers of 1024)")
    assert_one_line(ds_mla, "'fp8_ds_mla' is FlashMLA's packed format, which only DeepSeek-V4")


def test_plan_of_a_full_attention_model_speaks_of_no_retention_step() -> None:
    ran = kvoffload("plan", "tiny_llama")
    assert ran.code == 0 and ran.err == ""
    assert "every chunk of it" in ran.out and "retention step" not in ran.out


def test_help_is_plain_words_with_defaults() -> None:
    plan, replay, demo = kvoffload_all([["plan", "--help"], ["replay", "--help"],
                                        ["demo", "--help"]])  # fmt: skip
    for ran in (plan, replay, demo):
        assert ran.code == 0 and "``" not in ran.out and ":mod:" not in ran.out
    assert "(default: 16)" in plan.out and "(default: bfloat16)" in plan.out
    assert "(default: 1000)" in replay.out and "(default: 320)" in demo.out
    row = next(line for line in plan.out.splitlines() if line.startswith("  store_threshold"))
    meaning = next(line for line in plan.out.splitlines() if line.startswith("  cpu_bytes"))
    assert row.index("Keep a chunk") == meaning.index("Host-memory budget")  # one column


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"input_length": -100, "hash_ids": [1]}', "t.jsonl:2: 'input_length' -100 does not"),
        ('{"input_length": 100000000, "hash_ids": [1]}', "t.jsonl:2: 'input_length' 100000000"),
        ('{"input_length": true, "hash_ids": [1]}', "t.jsonl:2: 'input_length' True"),
        (json.dumps({"hash_ids": list(range(40000))}), "t.jsonl:2: 40,000 hash_ids"),
    ],
)
def test_trace_lines_that_make_no_sense_are_refused(
    tmp_path: Path, line: str, fragment: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"input_length": 10, "hash_ids": [1]}\n' + line + "\n")
    assert_one_line(kvoffload("replay", trace, "--capacity", "10"), fragment)


def test_replay_checks_its_plot_path_before_the_run(tmp_path: Path) -> None:
    missing, directory = kvoffload_all([
        ["replay", TRACE, "--plot", tmp_path / "no" / "x.png"],
        ["replay", TRACE, "--plot", tmp_path],
    ])  # fmt: skip
    assert_one_line(missing, "does not exist")
    assert_one_line(directory, "is a directory")


def test_replay_table_names_the_connectors_hit_ratio() -> None:
    ran = kvoffload("replay", TRACE, "--limit", "20", "--capacity", "100")
    assert ran.code == 0 and ran.err == ""  # no progress bar: stderr is no terminal
    header = ran.out.splitlines()[1]
    assert "gpu hit ratio" not in " ".join(header.split())
    assert "loaded" in header and "gpu cache" in header


def test_demo_says_when_it_reused_chunks_on_its_disk_path(tmp_path: Path) -> None:
    first = kvoffload("demo", "--requests", "30", "--disk-path", tmp_path)
    again = kvoffload("demo", "--requests", "30", "--disk-path", tmp_path, "--json")
    assert first.code == 0 and "reused:" not in first.out
    assert first.err == ""  # no tqdm frames when stderr is not a terminal
    report = json.loads(again.out)
    assert again.code == 0 and report["reused_disk_chunks"] > 0
    assert report["disk_path"] == str(tmp_path)


def test_plan_refuses_the_disk_paths_engine_start_refuses(tmp_path: Path) -> None:
    """A file, a path under a file, /proc: ``plan`` said OK where the engine refused. The
    engine calls ``build_offloading_config`` too: now the same refusal, word for word."""
    (tmp_path / "file").write_text("")
    layout = layout_from_hf_config(example_path("tiny_llama"))
    paths = (tmp_path / "file", tmp_path / "file" / "below", Path("/proc/kvoffload"))
    configs = [
        {"cpu_bytes_to_use": "1GiB", "disk_path": str(path), "disk_bytes_to_use": "1GiB"}
        for path in paths
    ]
    runs = kvoffload_all([["plan", "tiny_llama", "--extra-config", json.dumps(c)] for c in configs])
    why = ("is not a directory", "which is not a directory", "is on a proc file system")
    for extra, ran, fragment in zip(configs, runs, why, strict=True):
        with pytest.raises(ConfigError, match=fragment) as refused:
            build_offloading_config(extra, layout)
        assert_one_line(ran, str(refused.value))


def test_notes_go_to_the_engines_log_function_not_to_warnings(tmp_path: Path) -> None:
    layout = layout_from_hf_config(example_path("tiny_llama"))
    extra = {"cpu_bytes_to_use": "1GiB", "spec_name": "x", "disk_path": str(tmp_path / "new"),
             "disk_bytes_to_use": "1GiB"}  # fmt: skip
    lines: list[str] = []
    build_offloading_config(extra, layout, warn=lines.append)  # no warning: the suite errs on one
    assert lines[0].endswith("OffloadingConnector: spec_name")
    assert lines[1].startswith(f"disk_path {str(tmp_path / 'new')!r} does not exist")
    with pytest.warns(IgnoredKeysWarning):  # a library caller still gets the warning class
        build_offloading_config(extra, layout)
