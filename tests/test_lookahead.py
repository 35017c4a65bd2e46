"""Keys that name the tokens after a chunk, for drafters whose KV reads past it (EAGLE, MTP).

An EAGLE-like drafter computes its KV at position ``p`` from the target's
hidden state at ``p`` and the token at ``p + 1`` (a multi-module MTP: up to
``p + k``). A chunk's KV therefore depends on the ``k`` tokens after it, and
a chunk stored by a request that went on with other tokens must never load.
``KVLayout.lookahead`` makes every key name those tokens; a store waits until
they are known and the drafter's KV is final; a lookup never asks for a chunk
whose lookahead tokens the prompt does not have.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector.key_source import choose_engine_hashes
from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.errors import ConfigError
from kvoffload.keys import EngineHashes, extend_prefix_keys, namespace_of, prefix_keys
from kvoffload.messages import JobReport

SPAN = 4


def eagle_layout(lookahead: int = 1) -> KVLayout:
    """One full-attention group holding a target layer and a drafter layer, as vLLM forms it."""
    return KVLayout((CacheGroup("full", SPAN, ("target.0", "drafter.0"), 64),), lookahead)


def reference_keys(tokens: list[int], span: int, lookahead: int) -> list[bytes]:
    """The documented encoding: each chunk's int64 tokens and the ``lookahead`` after it."""
    header = b"kvoffload/prefix-key/v1\x00" + struct.pack("<IQ", 0, span)
    previous = hashlib.blake2b(header, digest_size=16).digest()
    keys = []
    for start in range(0, len(tokens) - span - lookahead + 1, span):
        data = struct.pack(f"<{span + lookahead}q", *tokens[start : start + span + lookahead])
        previous = hashlib.blake2b(previous + data, digest_size=16).digest()
        keys.append(previous)
    return keys


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**40), 2**40), max_size=60),
    span=st.integers(1, 7),
    lookahead=st.integers(0, 4),
    data=st.data(),
)
def test_keys_hash_the_lookahead_tokens_and_extend_alike(
    tokens: list[int], span: int, lookahead: int, data: st.DataObject
) -> None:
    full = reference_keys(tokens, span, lookahead)
    done = data.draw(st.integers(0, len(full)))
    for form in (tokens, np.array(tokens, dtype=np.int64)):
        got = extend_prefix_keys(full[:done], form, span, lookahead=lookahead)
        assert full[:done] + got == full
    least = done * span + lookahead
    stop = data.draw(st.integers(least, max(least, len(tokens))))
    head = reference_keys(tokens[:stop], span, lookahead)
    got = extend_prefix_keys(full[:done], tokens, span, stop=stop, lookahead=lookahead)
    assert full[:done] + got == head


def test_a_chunk_key_changes_with_the_token_after_it_and_no_lookahead_is_unchanged() -> None:
    tokens = list(range(100, 113))  # three chunks of 4 and one token more
    plain = prefix_keys(tokens, SPAN)
    assert extend_prefix_keys([], tokens, SPAN, lookahead=0) == plain
    ahead = extend_prefix_keys([], tokens, SPAN, lookahead=1)
    assert len(ahead) == 3 and not set(ahead) & set(plain)
    other = [*tokens[:8], 999, *tokens[9:]]  # token 8 follows chunk 1 and opens chunk 2
    moved = extend_prefix_keys([], other, SPAN, lookahead=1)
    assert moved[0] == ahead[0] and moved[1] != ahead[1]
    assert len(extend_prefix_keys([], tokens[:12], SPAN, lookahead=1)) == 2  # chunk 2: no next


def test_the_layout_lookahead_is_checked_and_in_the_namespace() -> None:
    assert namespace_of("m", "bfloat16", eagle_layout(0)) != namespace_of(
        "m", "bfloat16", eagle_layout(1)
    )
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ConfigError, match="lookahead"):
            eagle_layout(bad)  # type: ignore[arg-type]


def test_engine_keys_are_refused_and_auto_takes_token_keys() -> None:
    engine = EngineHashes(SPAN, "sha256")
    auto = build_offloading_config({"cpu_bytes_to_use": "1MiB"}, eagle_layout())
    assert choose_engine_hashes(auto, engine, reproducible=True) is None
    named = build_offloading_config(
        {"cpu_bytes_to_use": "1MiB", "key_source": "engine"}, eagle_layout()
    )
    with pytest.raises(ConfigError, match=r"key_source='engine' with a drafter.*'tokens'"):
        choose_engine_hashes(named, engine, reproducible=True)
    with pytest.raises(ConfigError, match="key_source='engine' with a drafter"):
        OffloadScheduler(auto, b"ns", engine_hashes=engine)


class Scheduler:
    """The scheduler side alone; stores complete at once, as a worker would report them."""

    def __init__(self, lookahead: int) -> None:
        config = build_offloading_config({"cpu_bytes_to_use": "1MiB"}, eagle_layout(lookahead))
        self.side = OffloadScheduler(config, b"ns")
        self.blocks = list(range(1, 65))

    def step(self, req_id: str, tokens: list[int], computed: int, scheduled: int) -> None:
        """One step of ``req_id`` whose stores succeed."""
        step = StepRequest(req_id, tokens, computed, scheduled, [self.blocks], len(tokens))
        for order in self.side.plan_step([step]):
            self.side.on_report(JobReport(order.job_id, 1, frozenset(), {}, {}))

    def stored(self, req_id: str) -> int:
        return int(self.side.stats()["stored_chunks"])


def test_a_chunk_is_stored_once_the_token_after_it_is_known() -> None:
    rig = Scheduler(lookahead=1)
    prompt = list(range(1, 13))  # 12 tokens: chunks end at 4, 8 and 12
    rig.step("r", prompt, computed=0, scheduled=12)  # the prefill
    assert rig.stored("r") == 2  # the chunk ending at 12 waits for token 12 (to be sampled)
    rig.step("r", [*prompt, 77], computed=12, scheduled=1)  # the first decode step
    assert rig.stored("r") == 3
    plain = Scheduler(lookahead=0)
    plain.step("r", prompt, computed=0, scheduled=12)
    assert plain.stored("r") == 3


def test_a_multi_token_drafters_last_tokens_wait_until_final() -> None:
    """With lookahead 3 the KV of the last 2 computed tokens is computed again next step."""
    rig = Scheduler(lookahead=3)
    prompt = list(range(1, 21))
    rig.step("r", prompt, computed=0, scheduled=9)  # 9 computed: KV final up to 7
    assert rig.stored("r") == 1
    rig.step("r", prompt, computed=9, scheduled=2)  # 11 computed: final up to 9
    assert rig.stored("r") == 2


def test_a_lookup_hits_only_chunks_whose_next_tokens_match() -> None:
    rig = Scheduler(lookahead=1)
    stored = list(range(1, 14))  # 13 tokens: chunks ending at 4, 8, 12 are keyed and stored
    rig.step("a", stored, computed=0, scheduled=13)
    assert rig.stored("a") == 3
    same = [*stored, 50, 51]
    assert rig.side.lookup("b", same, 0) == 12
    other_next = [*stored[:12], 99, 50, 51]  # goes on otherwise right after the third chunk
    assert rig.side.lookup("c", other_next, 0) == 8
    ends_there = stored[:12]  # no token after the third chunk to name in its key
    assert rig.side.lookup("d", ends_there, 0) == 8


def test_a_multi_token_lookahead_leaves_that_many_tokens_unhit() -> None:
    rig = Scheduler(lookahead=2)
    stored = list(range(1, 20))
    rig.step("a", stored, computed=0, scheduled=19)  # final up to 18, keyed up to 17: 4 chunks
    assert rig.stored("a") == 4
    assert rig.side.lookup("b", stored[:18], 0) == 16  # needs tokens 16 and 17 after chunk 4
    assert rig.side.lookup("c", stored[:17], 0) == 12
