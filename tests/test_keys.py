"""Chunk keys: stable, chained, separated by group and namespace, strictly validated."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError
from kvoffload.keys import (
    KEY_BYTES,
    extend_prefix_keys,
    namespace_of,
    prefix_keys,
    prefix_keys_for_layout,
    short_key,
)

#: Computed once with the v1 encoding; a change here breaks every stored chunk.
GOLDEN_RANGE40 = ["99c5d58d842b2c8d5e944fae21de1c4d", "7fede66959daeb2b76ba33fd2b52b9e6"]
GOLDEN_GROUP1_NS = "b73e0617876c699ca03f6a7a24ff3701"
GOLDEN_NAMESPACE = "21b756aa6b87db8b9190828592dce030"

tokens_st = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=70)


def layout(**changes: object) -> KVLayout:
    sliding = {
        "kind": "sliding",
        "tokens_per_block": 12,
        "layer_names": ("l0", "l1"),
        "page_bytes": 4096,
        "sliding_window": 64,
    }
    sliding.update(changes)
    full = CacheGroup(kind="full", tokens_per_block=16, layer_names=("l2",), page_bytes=4096)
    return KVLayout(groups=(CacheGroup(**sliding), full))  # type: ignore[arg-type]


def reference_keys(tokens: list[int], span: int, group: int, namespace: bytes) -> list[bytes]:
    """The documented encoding, written with struct instead of numpy."""
    header = b"kvoffload/prefix-key/v1\x00" + struct.pack("<IQ", group, span) + namespace
    previous = hashlib.blake2b(header, digest_size=16).digest()
    keys = []
    for start in range(0, len(tokens) - span + 1, span):
        chunk = struct.pack(f"<{span}q", *tokens[start : start + span])
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        keys.append(previous)
    return keys


def test_golden_values() -> None:
    assert [k.hex() for k in prefix_keys(list(range(40)), 16)] == GOLDEN_RANGE40
    keys = prefix_keys([5, -3, 2**40, 7], 2, group_idx=1, namespace=b"ns")
    assert keys[1].hex() == GOLDEN_GROUP1_NS
    assert namespace_of("org/model", "bfloat16", layout()).hex() == GOLDEN_NAMESPACE


def test_same_keys_in_another_process() -> None:
    code = (
        "from kvoffload.keys import prefix_keys;"
        "print(','.join(k.hex() for k in prefix_keys(list(range(40)), 16)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(Path(__file__).parents[1]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().split(",") == GOLDEN_RANGE40


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, span=st.integers(1, 9), group=st.integers(0, 3), ns=st.binary(max_size=8))
def test_matches_documented_encoding(tokens: list[int], span: int, group: int, ns: bytes) -> None:
    assert prefix_keys(tokens, span, group, ns) == reference_keys(tokens, span, group, ns)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, span=st.integers(1, 9), data=st.data())
def test_extend_continues_the_chain(tokens: list[int], span: int, data: st.DataObject) -> None:
    full = prefix_keys(tokens, span, 2, b"x")
    done = data.draw(st.integers(0, len(full)))
    assert full[:done] + extend_prefix_keys(full[:done], tokens, span, 2, b"x") == full
    stop = data.draw(st.integers(done * span, len(tokens)))
    head = prefix_keys(tokens[:stop], span, 2, b"x")
    assert full[:done] + extend_prefix_keys(full[:done], tokens, span, 2, b"x", stop=stop) == head


def test_one_key_per_full_chunk_each_naming_its_whole_prefix() -> None:
    tokens = list(range(100, 150))
    keys = prefix_keys(tokens, 16)
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 3
    changed_tail = prefix_keys([*tokens[:32], 0, *tokens[33:]], 16)
    assert changed_tail[:2] == keys[:2] and changed_tail[2] != keys[2]
    changed_head = prefix_keys([7, *tokens[1:]], 16)
    assert all(a != b for a, b in zip(changed_head, keys, strict=True))
    assert prefix_keys(tokens[:15], 16) == []
    assert prefix_keys([], 16) == []


def test_groups_spans_and_namespaces_never_share_keys() -> None:
    tokens = list(range(64))
    variants = [
        prefix_keys(tokens, 16),
        prefix_keys(tokens, 16, group_idx=1),
        prefix_keys(tokens, 16, namespace=b"other"),
        prefix_keys(tokens, 32),
        prefix_keys(tokens, 8),
    ]
    every = [k for keys in variants for k in keys]
    assert len(set(every)) == len(every)


def test_input_types_agree() -> None:
    tokens = list(range(-5, 27))
    expected = prefix_keys(tokens, 4)
    assert prefix_keys(tuple(tokens), 4) == expected
    assert prefix_keys(np.array(tokens, dtype=np.int32), 4) == expected
    assert prefix_keys(np.array(tokens, dtype=np.int64), 4) == expected
    assert prefix_keys(np.arange(8, dtype=np.uint16), 4) == prefix_keys(list(range(8)), 4)
    assert prefix_keys([np.int64(t) for t in tokens], 4) == expected


class ListView(Sequence[int]):
    """vLLM's ``ConstantList``: a read-only sequence over a list whose slices are lists."""

    def __init__(self, items: list[int]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, item: Any) -> Any:
        return self._items[item]


def test_a_read_only_view_of_a_list_hashes_like_the_list() -> None:
    tokens = list(range(1000, 1100))
    keys = prefix_keys(tokens, 8)
    assert prefix_keys(ListView(tokens), 8) == keys
    assert extend_prefix_keys(keys[:3], ListView(tokens), 8, stop=70) == keys[3:8]


@pytest.mark.parametrize("span", [0, -1, 2.0, True, "4", None])
def test_bad_chunk_span(span: object) -> None:
    with pytest.raises(ConfigError, match="tokens_per_chunk must be a positive int"):
        prefix_keys([1, 2, 3], span)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1.0, 2.0], "must be integers"),
        ([1, 2.7], "must be integers"),
        ([True, False], "must be integers"),
        ([[1, 2], [3, 4]], "must be 1-D"),
        ([2**64], "int64"),
        (np.array([2**63], dtype=np.uint64), "does not fit in int64"),
        ("abcd", "must be 1-D"),
    ],
)
def test_bad_tokens(tokens: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        prefix_keys(tokens, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("group", "namespace"), [(-1, b""), (2**32, b""), (True, b""), (0, "ns")])
def test_bad_group_or_namespace(group: object, namespace: object) -> None:
    with pytest.raises(ConfigError, match=r"group_idx|namespace"):
        prefix_keys([1], 1, group, namespace)  # type: ignore[arg-type]


def test_extend_refuses_more_keys_than_tokens() -> None:
    keys = prefix_keys(list(range(8)), 4)
    with pytest.raises(ConfigError, match="need at least 8 token ids, got 7"):
        extend_prefix_keys(keys, list(range(7)), 4)


def test_layout_keys_per_group() -> None:
    tokens = list(range(100))
    per_group = prefix_keys_for_layout(tokens, (12, 16), b"ns")
    assert per_group == [prefix_keys(tokens, 12, 0, b"ns"), prefix_keys(tokens, 16, 1, b"ns")]
    assert [len(keys) for keys in per_group] == [8, 6]
    with pytest.raises(ConfigError, match=r"tokens_per_chunk\[1\]"):
        prefix_keys_for_layout(tokens, (12, 0))
    with pytest.raises(ConfigError, match="one per group"):
        prefix_keys_for_layout(tokens, 16)  # type: ignore[arg-type]


def test_namespace_changes_with_everything_that_changes_kv_bytes() -> None:
    base = namespace_of("org/model", "bfloat16", layout())
    assert len(base) == KEY_BYTES
    assert namespace_of("org/model", "torch.bfloat16", layout()) == base
    variants = [
        namespace_of("org/other", "bfloat16", layout()),
        namespace_of("org/model", "float16", layout()),
        namespace_of("org/model", "bfloat16", layout(tokens_per_block=16)),
        namespace_of("org/model", "bfloat16", layout(layer_names=("l1", "l0"))),
        namespace_of("org/model", "bfloat16", layout(page_bytes=2048)),
        namespace_of("org/model", "bfloat16", layout(sliding_window=128)),
        namespace_of("org/model", "bfloat16", layout(kind="full", sliding_window=None)),
        namespace_of("org/model", "bfloat16", layout(kind="sliding_mla")),
        namespace_of(
            "org/model",
            "bfloat16",
            layout(kind="chunked_local", sliding_window=None, attention_chunk_size=64),
        ),
        namespace_of("org/model", "bfloat16", layout(layer_page_bytes=(4096, 2048))),
        namespace_of("org/model", "bfloat16", layout(layer_page_bytes=(2048, 4096))),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # One page size for every layer is the plain group: the namespace stays what it was.
    assert namespace_of("org/model", "bfloat16", layout(layer_page_bytes=(4096, 4096))) == base


def test_namespace_validation() -> None:
    with pytest.raises(ConfigError, match="model_id"):
        namespace_of("", "bfloat16", layout())
    with pytest.raises(ConfigError, match="dtype"):
        namespace_of("m", "", layout())


def test_short_key() -> None:
    assert short_key(bytes(range(16))) == "0001020304050607..."
    assert short_key(b"\xab") == "ab"
