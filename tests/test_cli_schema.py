"""The JSON that scripts read, and the lists the docs keep, held to docs/cli.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

from _cli import kvoffload_all

from kvoffload.config.architectures import KNOWN_MODEL_TYPES

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
_TYPES = {
    "int": int,
    "string": str,
    "bool": bool,
    "number": float,
    "list": list,
    "object": dict,
    "null": type(None),
}


def documented(section: str) -> dict[str, set[type]]:
    """Field -> the JSON types its row in docs/cli.md allows, between the section's markers."""
    text = DOCS.read_text()
    body = text.split(f"<!-- {section}:start -->")[1].split(f"<!-- {section}:end -->")[0]
    fields = {}
    for name, kinds in re.findall(r"^\| `(\w+)` \| ([^|]+) \|", body, re.MULTILINE):
        allowed = {_TYPES[word] for word in re.findall(r"\w+", kinds) if word in _TYPES}
        if float in allowed:
            allowed.add(int)
        fields[name] = allowed
    return fields


def assert_matches(document: dict[str, object], section: str, *, optional: set[str]) -> None:
    schema = documented(section)
    assert set(document) <= set(schema), set(document) - set(schema)
    assert set(schema) - set(document) <= optional, set(schema) - set(document)
    for name, value in document.items():
        kind = type(value) if not isinstance(value, bool) else bool
        assert kind in schema[name] or (kind is int and bool not in schema[name] and
                                        float in schema[name]), (name, value)  # fmt: skip


def test_plan_json_is_the_documented_schema(tmp_path: Path) -> None:
    extra = json.dumps({"cpu_bytes_to_use": "1GiB", "disk_path": str(tmp_path),
                        "disk_bytes_to_use": "1GiB", "store_threshold": 2,
                        "tenant_cpu_share": 0.5, "remote_url": "redis://127.0.0.1:1/0",
                        "offload_prompt_only": True, "key_source": "tokens"})  # fmt: skip
    mtp = tmp_path / "mtp.json"  # DeepSeek-V3's MLA with one MTP layer
    mtp.write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 2,
                               "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                               "num_nextn_predict_layers": 1}))  # fmt: skip
    runs = kvoffload_all([
        ["plan", "tiny_qwen3_next", "--extra-config", extra, "--json"],
        ["plan", "tiny_deepseek_v4", "--dtype", "fp8_ds_mla", "--json"],
        ["plan", "tiny_llama", "--draft-model", "tiny_llama", "--speculative-method", "eagle",
         "--json"],
        ["plan", mtp, "--speculative-method", "mtp", "--json"],
    ])  # fmt: skip
    for ran in runs:
        assert ran.code == 0, ran.err
        plan = json.loads(ran.out)
        assert plan["schema"] == 1
        groups = plan.pop("groups")
        assert_matches(plan, "plan-json", optional={"groups"})
        for group in groups:
            assert_matches(group, "plan-json-groups",
                           optional={"cpu_tokens_if_alone", "cpu_states_if_alone",
                                     "drafter_layers", "drafter_chunk_bytes",
                                     "drafter_layer_names"})  # fmt: skip
    plan = json.loads(runs[0].out)
    # What the issue found missing is there, with the values given.
    assert plan["store_threshold"] == 2 and plan["key_source"] == "tokens"
    assert plan["tenant_cpu_share"] == 0.5 and plan["offload_prompt_only"] is True
    assert plan["disk_bytes_to_use"] == 1 << 30 and plan["remote_url"] == "redis://127.0.0.1:1/0"
    assert plan["retention_interval"] == 16384
    assert plan["groups"][0]["needs"].startswith("the state at H")
    assert (plan["speculative_method"], plan["lookahead"]) == (None, 0)
    eagle = json.loads(runs[2].out)  # a drafter's fields, documented and filled in
    assert (eagle["speculative_method"], eagle["lookahead"]) == ("eagle", 1)
    assert eagle["groups"][0]["drafter_layers"] == 2
    mtp_plan = json.loads(runs[3].out)
    assert (mtp_plan["speculative_method"], mtp_plan["num_speculative_tokens"]) == ("mtp", 1)
    assert mtp_plan["groups"][0]["drafter_layer_names"] == ["model.layers.2.self_attn.attn"]


def test_plan_json_tells_every_field_the_table_shows() -> None:
    table, as_json = kvoffload_all([["plan", "tiny_gemma4"], ["plan", "tiny_gemma4", "--json"]])
    plan = json.loads(as_json.out)
    for group in plan["groups"]:
        for cell in (group["kind"], group["needs"], group["page"]):
            assert cell in table.out


def test_inspect_json_is_the_documented_schema(tmp_path: Path) -> None:
    from kvoffload.cli.inspect import report_json
    from kvoffload.tiers.disk.inspect import NamespaceReport, inspect_disk

    report = inspect_disk(tmp_path)
    report.namespaces.append(NamespaceReport("00" * 16, oldest_use_ns=1, newest_use_ns=2))
    document = report_json(report)
    namespaces = document.pop("namespaces")
    assert_matches(document, "inspect-json", optional={"namespaces"})
    assert set(documented("inspect-json")) == {*document, "namespaces"}
    for namespace in namespaces:
        assert_matches(namespace, "inspect-json-namespaces", optional=set())


def test_the_docs_list_the_known_model_types() -> None:
    assert list(documented("known-model-types")) == list(KNOWN_MODEL_TYPES)
    rows = DOCS.read_text().split("<!-- known-model-types:start -->")[1]
    for name, what in KNOWN_MODEL_TYPES.items():
        assert f"| `{name}` | {what} |" in rows
