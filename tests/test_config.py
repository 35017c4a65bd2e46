"""build_offloading_config: the vLLM contract and every rule of the key table."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
from _numbers import NUMBERS
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import (
    POLICIES,
    CacheGroup,
    ConfigError,
    IgnoredKeysWarning,
    KVLayout,
    OffloadConfig,
    build_offloading_config,
)
from kvoffload.config import KEYS
from kvoffload.config.keys import IGNORED_KEYS
from kvoffload.registry import DEFAULT_POLICY

MIB = 1 << 20


def build(layout: KVLayout, **extra: Any) -> OffloadConfig:
    extra.setdefault("cpu_bytes_to_use", MIB)
    return build_offloading_config(extra, layout)


# -- the three cases of the vLLM change --------------------------------------------


def test_heterogeneous_groups_accept_blocks_per_chunk(hetero_layout: KVLayout) -> None:
    cfg = build_offloading_config({"blocks_per_chunk": 2, "cpu_bytes_to_use": MIB}, hetero_layout)
    assert isinstance(cfg, OffloadConfig)
    assert cfg.tokens_per_block == (12, 16)
    assert cfg.blocks_per_chunk == 2
    assert cfg.tokens_per_chunk == (24, 32)
    assert cfg.chunk_bytes == (2 * 2 * 4096, 2 * 1 * 4096)
    assert cfg.num_cpu_chunks == MIB // max(cfg.chunk_bytes)


def test_block_size_with_blocks_per_chunk_is_rejected(uniform_layout: KVLayout) -> None:
    with pytest.raises(ConfigError, match="Specify only one of 'block_size' or 'blocks_per_chunk'"):
        build(uniform_layout, block_size=32, blocks_per_chunk=2)


@pytest.mark.parametrize("value", [0, -1, "0", -3.0])
def test_blocks_per_chunk_must_be_positive(hetero_layout: KVLayout, value: object) -> None:
    with pytest.raises(ConfigError, match="'blocks_per_chunk' must be greater than 0"):
        build(hetero_layout, blocks_per_chunk=value)


# -- block_size, the older path -------------------------------------------------


def test_block_size_converts_tokens_to_blocks_on_a_uniform_layout(
    uniform_layout: KVLayout,
) -> None:
    cfg = build(uniform_layout, block_size=64)
    assert cfg.blocks_per_chunk == 4
    assert cfg.tokens_per_chunk == (64,)


def test_block_size_on_heterogeneous_groups_names_the_sizes_and_the_fix(
    hetero_layout: KVLayout,
) -> None:
    with pytest.raises(ConfigError, match=r"\[12, 16\].*use 'blocks_per_chunk' instead"):
        build(hetero_layout, block_size=48)


def test_block_size_must_be_a_multiple_of_the_block(uniform_layout: KVLayout) -> None:
    with pytest.raises(ConfigError, match=r"not a multiple of .* 16"):
        build(uniform_layout, block_size=24)


@pytest.mark.parametrize("value", [0, -16])
def test_block_size_must_be_positive(uniform_layout: KVLayout, value: int) -> None:
    with pytest.raises(ConfigError, match="'block_size' must be greater than 0"):
        build(uniform_layout, block_size=value)


def test_neither_key_means_one_block_per_chunk(hetero_layout: KVLayout) -> None:
    cfg = build(hetero_layout)
    assert cfg.blocks_per_chunk == 1
    assert cfg.tokens_per_chunk == (12, 16)


# -- integer, size and boolean spellings ----------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [(2, 2), ("2", 2), (2.0, 2), (" 3 ", 3), ("4.0", 4)])
def test_integers_accept_exact_spellings(
    hetero_layout: KVLayout, raw: object, expected: int
) -> None:
    assert build(hetero_layout, blocks_per_chunk=raw).blocks_per_chunk == expected


@pytest.mark.parametrize("raw", [True, False, 2.5, "abc", None, [2], {"n": 2}, "2.5", float("nan")])
def test_integers_reject_everything_else_naming_key_and_value(
    hetero_layout: KVLayout, raw: object
) -> None:
    with pytest.raises(ConfigError, match="'blocks_per_chunk' must be an integer") as info:
        build(hetero_layout, blocks_per_chunk=raw)
    assert repr(raw)[:20] in str(info.value)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (1 << 30, 1 << 30),
        ("512MiB", 512 * MIB),
        ("8GiB", 8 << 30),
        ("500MB", 500 * 10**6),
        ("8GB", 8 * 10**9),
        ("1.5GiB", 3 << 29),
        ("2 mib", 2 * MIB),
        ("1048576", MIB),
        (1e9, 10**9),
    ],
)
def test_sizes_accept_binary_and_decimal_units(
    hetero_layout: KVLayout, raw: object, expected: int
) -> None:
    assert build(hetero_layout, cpu_bytes_to_use=raw).cpu_bytes_to_use == expected


@pytest.mark.parametrize("raw", ["8 parsecs", "GiB", "-1GiB", "1.0000000001KB", True, None, 1.5])
def test_sizes_reject_nonsense(hetero_layout: KVLayout, raw: object) -> None:
    with pytest.raises(ConfigError, match="'cpu_bytes_to_use'"):
        build(hetero_layout, cpu_bytes_to_use=raw)


def test_cpu_budget_is_required_and_positive(hetero_layout: KVLayout) -> None:
    with pytest.raises(ConfigError, match="'cpu_bytes_to_use' is required"):
        build_offloading_config({"blocks_per_chunk": 1}, hetero_layout)
    with pytest.raises(ConfigError, match="'cpu_bytes_to_use' must be greater than 0"):
        build(hetero_layout, cpu_bytes_to_use=0)


def test_cpu_budget_must_hold_one_chunk_and_says_the_minimum(hetero_layout: KVLayout) -> None:
    with pytest.raises(ConfigError, match=r"is 16384 bytes .*at least 16384 bytes") as info:
        build(hetero_layout, blocks_per_chunk=2, cpu_bytes_to_use=16383)
    assert "16383" in str(info.value)
    assert build(hetero_layout, blocks_per_chunk=2, cpu_bytes_to_use=16384).num_cpu_chunks == 1


def test_cpu_budget_is_the_total_across_workers(hetero_layout: KVLayout) -> None:
    cfg = build_offloading_config({"cpu_bytes_to_use": MIB}, hetero_layout, world_size=4)
    assert cfg.num_cpu_chunks == MIB // 4 // cfg.max_chunk_bytes
    with pytest.raises(ConfigError, match="4 worker"):
        build_offloading_config({"cpu_bytes_to_use": 8192 * 3}, hetero_layout, world_size=4)
    with pytest.raises(ConfigError, match="'world_size' must be greater than 0"):
        build_offloading_config({"cpu_bytes_to_use": MIB}, hetero_layout, world_size=0)


@pytest.mark.parametrize(("raw", "expected"), [(True, True), ("false", False), ("TRUE", True)])
def test_booleans_accept_true_and_false(
    hetero_layout: KVLayout, raw: object, expected: bool
) -> None:
    assert build(hetero_layout, offload_prompt_only=raw).offload_prompt_only is expected


@pytest.mark.parametrize("raw", ["yes", 1, 0, "", None, "f"])
def test_booleans_reject_truthy_things(hetero_layout: KVLayout, raw: object) -> None:
    with pytest.raises(ConfigError, match="'offload_prompt_only' must be true or false"):
        build(hetero_layout, offload_prompt_only=raw)


# -- policies, unknown and vLLM-only keys -----------------------------------------------


def test_eviction_policy_must_be_registered_and_the_error_lists_them(
    hetero_layout: KVLayout,
) -> None:
    for name in POLICIES.names():
        assert build(hetero_layout, eviction_policy=name).eviction_policy == name
    assert build(hetero_layout).eviction_policy == DEFAULT_POLICY
    with pytest.raises(ConfigError, match="'lru', 'arc', 's3fifo'"):
        build(hetero_layout, eviction_policy="fifo")


def test_an_unknown_key_lists_the_known_ones_and_suggests_the_closest(
    hetero_layout: KVLayout,
) -> None:
    with pytest.raises(ConfigError, match="did you mean 'blocks_per_chunk'") as info:
        build(hetero_layout, blocks_per_chuck=2)
    for key in KEYS:
        assert key.name in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'\. Known keys"):
        build(hetero_layout, zzz=1)


def test_keys_of_vllms_connector_are_accepted_with_one_warning(hetero_layout: KVLayout) -> None:
    extra = {name: "anything" for name in sorted(IGNORED_KEYS)}
    with pytest.warns(IgnoredKeysWarning) as record:
        cfg = build(hetero_layout, **extra)
    assert len(record) == 1
    for name in IGNORED_KEYS:
        assert name in str(record[0].message)
    assert cfg == build(hetero_layout)


def test_store_threshold_and_prompt_only_defaults(hetero_layout: KVLayout) -> None:
    cfg = build(hetero_layout)
    assert (cfg.store_threshold, cfg.offload_prompt_only) == (1, False)
    assert build(hetero_layout, store_threshold="2").store_threshold == 2
    with pytest.raises(ConfigError, match="'store_threshold' must be greater than 0"):
        build(hetero_layout, store_threshold=0)


# -- disk keys -----------------------------------------------------------------------


def test_disk_keys_need_each_other_and_a_chunk_of_room(
    hetero_layout: KVLayout, tmp_path: Any
) -> None:
    with pytest.raises(ConfigError, match="'disk_path' needs 'disk_bytes_to_use'"):
        build(hetero_layout, disk_path=str(tmp_path))
    with pytest.raises(ConfigError, match="'disk_bytes_to_use' needs 'disk_path'"):
        build(hetero_layout, disk_bytes_to_use="1GiB")
    with pytest.raises(ConfigError, match="'disk_bytes_to_use'=100 holds no chunk"):
        build(hetero_layout, disk_path=str(tmp_path), disk_bytes_to_use=100)
    cfg = build(hetero_layout, disk_path=tmp_path, disk_bytes_to_use="1MiB")
    assert cfg.disk_path == str(tmp_path)
    assert cfg.num_disk_chunks == MIB // (4096 + cfg.max_chunk_bytes)  # header block per chunk
    with pytest.raises(ConfigError, match="'disk_path' must be a non-empty directory path"):
        build(hetero_layout, disk_path="", disk_bytes_to_use="1MiB")


def test_the_disk_budget_is_shared_by_every_rank(hetero_layout: KVLayout, tmp_path: Any) -> None:
    """disk_bytes_to_use is the directory's: with two ranks each chunk is two files in it."""
    disk = {"cpu_bytes_to_use": 2 * MIB, "disk_path": str(tmp_path), "disk_bytes_to_use": MIB}
    two = build_offloading_config(disk, hetero_layout, world_size=2)
    footprint = 4096 + two.max_chunk_bytes
    assert two.num_disk_chunks == MIB // (2 * footprint)
    assert f"{two.num_disk_chunks} chunks" in str(two) and "shared by every" in str(two)
    with pytest.raises(ConfigError, match=rf"holds no chunk.*for 2 rank.*at least {2 * footprint}"):
        build_offloading_config({**disk, "disk_bytes_to_use": footprint}, hetero_layout, 2)
    assert build(hetero_layout, **{**disk, "disk_bytes_to_use": footprint}).num_disk_chunks == 1


# -- the result ------------------------------------------------------------------------


def test_config_is_frozen_hashable_and_prints_a_table(hetero_layout: KVLayout) -> None:
    cfg = build(hetero_layout, blocks_per_chunk=2)
    assert hash(cfg) == hash(build(hetero_layout, blocks_per_chunk="2"))
    with pytest.raises(AttributeError):
        cfg.blocks_per_chunk = 3  # type: ignore[misc]
    text = str(cfg)
    assert "tokens/chunk" in text
    assert "sliding" in text
    assert "64 chunks per worker" in text


def test_non_mapping_inputs_are_config_errors(hetero_layout: KVLayout) -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        build_offloading_config(["blocks_per_chunk"], hetero_layout)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a KVLayout"):
        build_offloading_config({}, "layout")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown key 3"):
        build_offloading_config({3: 1}, hetero_layout)  # type: ignore[dict-item]


def test_every_key_sets_the_offload_config_field_of_its_name() -> None:
    fields = {field.name for field in dataclasses.fields(OffloadConfig)}
    not_keys = {"layout", "world_size", "kv_role"}  # handed over by the engine
    assert {key.name for key in KEYS if key.sets_field} == fields - not_keys
    assert [key.name for key in KEYS if key.required] == ["cpu_bytes_to_use"]


def test_a_key_left_out_takes_the_default_the_key_table_shows(hetero_layout: KVLayout) -> None:
    cfg = build(hetero_layout, remote_url="redis://127.0.0.1:1/0")
    shown = {key.name: key.default for key in KEYS if key.default is not None}
    assert shown == {
        "blocks_per_chunk": 1,
        "eviction_policy": DEFAULT_POLICY,
        "store_threshold": 1,
        "offload_prompt_only": False,
        "key_source": "auto",
        "transfer_kernel": "off",
        "load_in_step": "auto",
        "retention_interval": 16384,
        "remote_timeout_ms": 100,
        "remote_retry_ms": 10000,
        "remote_queue_bytes": 256 * MIB,
        "consumer_write_back": False,
        "handoff_wait_ms": 10000,
        "queued_cpu_share": 0.25,
        "retention_cpu_share": 0.5,
        "fetch_while_queued": False,
    }
    assert {name: getattr(cfg, name) for name in shown} == shown
    assert cfg.disk_path is None and cfg.disk_bytes_to_use == 0  # no disk tier: no default shown


#: Keys that take one of a few names: (key, accepted spellings -> value, refused values, the
#: choices the refusal names).
CHOICE_KEYS = [
    ("transfer_kernel", {"AUTO": "auto", " always ": "always", "off": "off"},
     ["on", "", 1, True, None], "'off' or 'auto' or 'always'"),
    ("load_in_step", {"AUTO": "auto", " always ": "always", "Never": "never"},
     ["sync", "", 1, True, None], "'auto' or 'always' or 'never'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [(key, raw, value) for key, taken, _, _ in CHOICE_KEYS for raw, value in taken.items()],
)
def test_a_choice_key_takes_its_choices_in_any_case(
    hetero_layout: KVLayout, key: str, raw: str, expected: str
) -> None:
    assert getattr(build(hetero_layout, **{key: raw}), key) == expected


@pytest.mark.parametrize(
    ("key", "raw", "choices"),
    [(key, raw, choices) for key, _, refused, choices in CHOICE_KEYS for raw in refused],
)
def test_a_choice_key_refuses_anything_else_naming_the_choices(
    hetero_layout: KVLayout, key: str, raw: object, choices: str
) -> None:
    with pytest.raises(ConfigError, match=rf"{key}.*{choices}"):
        build(hetero_layout, **{key: raw})


# -- rule 11: nothing but ConfigError escapes, for any value, huge and non-finite included --

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["2", "2.0", "1GiB", "8 GB", "true", "lru", "1e999999", "-0", "0x10"])
    | NUMBERS
    | st.sampled_from(["redis://h/" + "9" * 5000, "redis://h/\u00b2", "redis://h:99999999/0"]),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children)
    ),
    max_leaves=5,
)
_names = st.sampled_from([key.name for key in KEYS]) | st.text(max_size=20) | st.integers()


#: Mappings with a valid CPU budget half of the time, so a bad value meets every later check.
_extras = st.builds(
    lambda budget, rest: {**budget, **rest},
    st.sampled_from([{}, {"cpu_bytes_to_use": "1GiB"}]),
    st.dictionaries(_names, _values, max_size=6),
)


@settings(max_examples=400, deadline=None)
@given(extra=_extras, world_size=st.integers(-2, 4) | _values)
def test_only_config_errors_escape(extra: dict[Any, Any], world_size: Any) -> None:
    layout = KVLayout(
        groups=(
            CacheGroup("sliding", 12, ("l0", "l1"), 4096, sliding_window=64),
            CacheGroup("full", 16, ("l2",), 4096),
        )
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg = build_offloading_config(extra, layout, world_size=world_size)
        except ConfigError:
            return
    assert all(issubclass(w.category, IgnoredKeysWarning) for w in caught)
    assert cfg.num_cpu_chunks >= 1
    for key in KEYS:
        if key.bounds is not None and key.sets_field:
            assert key.bounds.minimum <= getattr(cfg, key.name) <= key.bounds.maximum or (
                key.name == "disk_bytes_to_use" and cfg.disk_bytes_to_use == 0
            )
