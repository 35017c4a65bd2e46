"""Every number a user gives is checked against a documented range, and only ConfigError escapes.

Huge integers, non-finite floats and strings that spell either are the inputs
that used to escape as ``OverflowError`` (``float()`` of a huge int) or to be
accepted and crash the engine later (``remote_timeout_ms=10**400``).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
from _numbers import NUMBERS
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import CacheGroup, ConfigError, KVLayout, OffloadConfig, build_offloading_config
from kvoffload.cli import main
from kvoffload.config import KEYS, render_key_table
from kvoffload.config.keys import REQUIRES, Key, KeyType
from kvoffload.config.remote_url import parse_remote_url
from kvoffload.config.values import format_bytes

NUMERIC_KEYS = [key for key in KEYS if key.bounds is not None]
#: What a key that needs another gets, so only the key under test can be wrong.
_COMPANIONS = {
    "disk_path": "/nonexistent/kvoffload-test",
    "disk_bytes_to_use": 2**60,
    "remote_url": "redis://127.0.0.1:1/0",
}


def build_with(layout: KVLayout, key: Key, value: object) -> OffloadConfig:
    """A configuration that is valid (room for any chunk) except, perhaps, ``key``."""
    extra: dict[str, object] = {"cpu_bytes_to_use": 2**60, key.name: value}
    for other in REQUIRES.get(key.name, ()):
        extra.setdefault(other, _COMPANIONS[other])
    role = _SPLIT_ROLE_KEYS.get(key.name)
    if role is not None:  # a split role needs a tier the engines share
        extra.setdefault("remote_url", "redis://127.0.0.1:1/0")
    return build_offloading_config(extra, layout, kv_role=role)


#: Keys that apply to one of vLLM's split roles only, and a role they apply to.
_SPLIT_ROLE_KEYS = {"handoff_wait_ms": "kv_consumer"}


def the_value(config: OffloadConfig, key: Key) -> int:
    if key.name == "block_size":  # read into blocks_per_chunk (16 tokens per block here)
        return config.blocks_per_chunk * config.tokens_per_block[0]
    value: int = getattr(config, key.name)
    return value


def test_every_integer_and_size_key_has_bounds() -> None:
    assert {key.name for key in NUMERIC_KEYS} == {
        key.name for key in KEYS if key.type in (KeyType.INT, KeyType.SIZE)
    }
    with pytest.raises(ConfigError, match="take bounds"):
        Key("n", KeyType.INT, "a number without a range")


@pytest.mark.parametrize("key", NUMERIC_KEYS, ids=lambda key: key.name)
def test_the_key_table_shows_each_upper_bound(key: Key) -> None:
    assert key.bounds is not None
    row = next(r for r in render_key_table().splitlines() if r.startswith(f"| `{key.name}` |"))
    top = key.bounds.maximum
    assert (format_bytes(top) if key.type is KeyType.SIZE else f"{top:,}") in row


@pytest.mark.parametrize("key", NUMERIC_KEYS, ids=lambda key: key.name)
def test_the_maximum_is_accepted_and_below_the_minimum_is_not(
    uniform_layout: KVLayout, key: Key
) -> None:
    assert key.bounds is not None
    top = key.bounds.maximum
    for value in (top, str(top), float(top)):
        assert the_value(build_with(uniform_layout, key, value), key) == top
    low = key.bounds.minimum - 1
    bound = "greater than 0" if low == 0 else f"at least {key.bounds.minimum:,}"
    with pytest.raises(ConfigError, match=f"^{key.name!r} must be {bound}, got {low}$"):
        build_with(uniform_layout, key, low)


@pytest.mark.parametrize("key", NUMERIC_KEYS, ids=lambda key: key.name)
@pytest.mark.parametrize(
    "raw",
    [
        "above",
        10**400,
        1e306,
        1.7976931348623157e308,
        "1" + "0" * 320,
        "1e306",
        "1E+400",
        "1e999999999",
        int("9" * 4000) * 10**1000,  # longer than str() of an int may be
    ],
    ids=["max+1", "10**400", "1e306", "max-float", "1+320-zeros", "'1e306'", "'1E+400'",
         "'1e999999999'", "5000-digits"],
)  # fmt: skip
def test_above_the_bound_is_a_config_error_naming_key_and_bound(
    uniform_layout: KVLayout, key: Key, raw: object
) -> None:
    assert key.bounds is not None
    if raw == "above":
        raw = key.bounds.maximum + 1
    with pytest.raises(ConfigError) as info:
        build_with(uniform_layout, key, raw)
    message = str(info.value)
    if key.type is KeyType.SIZE and isinstance(raw, str) and "e" in raw.lower():
        assert message.startswith(f"{key.name!r} must be a byte count")  # no exponents in sizes
    else:
        assert message.startswith(f"{key.name!r} must be at most {key.bounds.maximum:,}")
    assert len(message) < 300


@pytest.mark.parametrize("key", NUMERIC_KEYS, ids=lambda key: key.name)
@pytest.mark.parametrize("raw", [float("inf"), float("-inf"), float("nan"), "inf", "NaN", "sNaN"])
def test_non_finite_numbers_are_config_errors(
    uniform_layout: KVLayout, key: Key, raw: object
) -> None:
    with pytest.raises(ConfigError, match=f"^{key.name!r} must be "):
        build_with(uniform_layout, key, raw)


def test_a_size_string_keeps_every_digit() -> None:
    layout = KVLayout(groups=(CacheGroup("full", 16, ("l0",), 4096),))
    # 29 significant digits: rounded to Decimal's default 28, this would pass for 1 MiB.
    with pytest.raises(ConfigError, match="a whole number of bytes"):
        build_offloading_config({"cpu_bytes_to_use": "1.0000000000000000000000000001MiB"}, layout)
    exact = {"cpu_bytes_to_use": "1.5000000000000000000000000000MiB"}
    assert build_offloading_config(exact, layout).cpu_bytes_to_use == 3 << 19


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://h/" + "9" * 5000, "a database number"),
        ("redis://h/\u00b2", "a database number"),  # isdigit(), but no int()
        ("redis://h/2147483648", "past Redis's largest, 2147483647"),
    ],
)
def test_a_remote_url_database_number_is_checked(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_remote_url("remote_url", url)
    assert parse_remote_url("remote_url", "redis://h/2147483647").db == 2**31 - 1


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (1152, "1.12 KiB"),  # 1.125: ties round to even, as float formatting did
        (256 << 20, "256 MiB"),
        (2**60, "1 EiB"),
        (2**70, "about 2^70 B"),
        (-2048, "-2 KiB"),
    ],
)
def test_format_bytes_is_exact_for_any_int(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_of_an_int_longer_than_str_allows() -> None:
    assert format_bytes(10**5000) == f"about 2^{(10**5000).bit_length() - 1} B"


# -- the property: any number, any key, only ConfigError, and what passes is in range -------


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(NUMERIC_KEYS), raw=NUMBERS)
def test_any_number_is_a_config_error_or_a_value_in_range(key: Key, raw: Any) -> None:
    layout = KVLayout(groups=(CacheGroup("full", 16, ("l0",), 4096),))
    assert key.bounds is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            config = build_with(layout, key, raw)
        except ConfigError as exc:
            assert str(exc).startswith(repr(key.name))
            return
    assert key.bounds.minimum <= the_value(config, key) <= key.bounds.maximum


# -- `kvoffload plan`: one line, exit 2 ------------------------------------------------------


@pytest.mark.parametrize("key", NUMERIC_KEYS, ids=lambda key: key.name)
@pytest.mark.parametrize(
    "value",
    ["1e306", "1" + "0" * 320, '"1' + "0" * 320 + '"', "Infinity", "-Infinity", "NaN", '"1e400"'],
)
def test_plan_prints_one_line_and_exits_2(
    capsys: pytest.CaptureFixture[str], key: Key, value: str
) -> None:
    extra = {"cpu_bytes_to_use": "1GiB", key.name: "VALUE"}
    for other in REQUIRES.get(key.name, ()):
        extra.setdefault(other, _COMPANIONS[other])
    text = json.dumps(extra).replace('"VALUE"', value)
    assert main(["plan", "tiny_llama", "--extra-config", text]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"kvoffload plan: error: {key.name!r} must be ")


def test_plan_refuses_a_json_number_longer_than_python_reads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = '{"cpu_bytes_to_use": 1' + "0" * 5000 + "}"
    assert main(["plan", "tiny_llama", "--extra-config", text]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--extra-config is not valid JSON" in err
