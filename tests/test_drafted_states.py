"""Speculative decoding beside a recurrent group: no state accepted drafts moved is stored.

vLLM keeps, at a block boundary that accepted draft tokens crossed, a state
that is not a recompute's (``tests_e2e/test_speculative_recurrent.py`` measures
it on Qwen3-Next with an MTP layer). The scheduler side stores a recurrent
state only where a step without draft tokens (a prefill) reached its boundary
(:mod:`kvoffload.connector._drafts`); the attention KV of accepted drafts is
stored all the same. The steps here are vLLM's: a step verifying ``k`` drafts
schedules ``1 + k`` tokens past the ``computed`` ones, of which only the last
sampled token is in the request's tokens; the next step starts after the
accepted ones.
"""

from __future__ import annotations

import pytest

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector._request import StepRequest
from kvoffload.connector.scheduler import OffloadScheduler
from kvoffload.messages import JobReport

BLOCK = 4
#: Qwen3-Next with an MTP layer, as vLLM groups it: a gated-DeltaNet state group, and one
#: full-attention group holding the target's attention layer and the MTP layer's.
LAYOUT = KVLayout(
    (CacheGroup("mamba", BLOCK, ("m0",), 64), CacheGroup("full", BLOCK, ("a0", "mtp.0"), 64)),
    lookahead=1,
)
PROMPT = list(range(100, 110))  # 10 tokens: a prefill step to 8 (align mode), one to 10


class Rig:
    """The scheduler side alone; stores complete at once, as a worker reports them."""

    def __init__(self, blocks_per_chunk: int = 1, layout: KVLayout = LAYOUT) -> None:
        config = build_offloading_config(
            {"cpu_bytes_to_use": "1MiB", "blocks_per_chunk": blocks_per_chunk}, layout
        )
        self.side = OffloadScheduler(config, b"ns")
        self.blocks = [list(range(1 + 100 * g, 100 * (g + 1))) for g in range(len(layout.groups))]

    def step(self, req: str, tokens: list[int], computed: int, scheduled: int, prompt: int) -> None:
        step = StepRequest(req, tokens, computed, scheduled, self.blocks, prompt)
        for order in self.side.plan_step([step]):
            self.side.on_report(JobReport(order.job_id, 1, frozenset(), {}, {}))

    def prefill(self, req: str, tokens: list[int], start: int = 0) -> None:
        """vLLM's align-mode prefill: to the last block boundary, then the rest."""
        aligned = (len(tokens) - 1) // BLOCK * BLOCK
        if aligned > start:
            self.step(req, tokens, start, aligned - start, len(tokens))
        self.step(req, tokens, max(start, aligned), len(tokens) - max(start, aligned), len(tokens))

    def decode(self, req: str, tokens: list[int], steps: int, drafts: int, accept: int) -> None:
        """``steps`` decode steps verifying ``drafts`` drafts each, ``accept`` of them accepted:
        each appends the accepted drafts and one sampled token to ``tokens`` (the prompt)."""
        prompt = len(tokens)  # the prompt, computed
        tokens.append(7)  # the token the prefill sampled
        for _ in range(steps):
            computed = len(tokens) - 1
            self.step(req, tokens, computed, 1 + drafts, prompt)
            tokens.extend(range(len(tokens), len(tokens) + accept + 1))

    def local_hit(self, req: str, tokens: list[int], hit: int) -> None:
        """vLLM's own cache serves ``hit`` tokens of ``req``; the connector offers none."""
        assert self.side.lookup(req, tokens, hit) == 0
        self.side.plan_load(req, self.blocks, 0)

    def stat(self, name: str) -> int:
        return int(self.side.stats()[name])


def conversation(rig: Rig, drafts: int, accept: int) -> list[int]:
    """A first turn: the prompt, then 12 decode steps; its tokens after it finished."""
    tokens = list(PROMPT)
    rig.prefill("t1", tokens)
    rig.decode("t1", tokens, steps=12, drafts=drafts, accept=accept)
    rig.side.request_finished("t1")
    return tokens


def test_a_step_verifying_drafts_schedules_past_the_requests_tokens() -> None:
    assert StepRequest("r", [1] * 11, 10, 3, [[]], 10).drafts == 2
    assert StepRequest("r", [1] * 11, 10, 1, [[]], 10).drafts == 0  # a plain decode step
    assert StepRequest("r", [1] * 20, 8, 12, [[]], 20).drafts == 0  # a prefill step


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_next_turn_hits_the_last_prefill_boundary_not_a_drafted_one(
    blocks_per_chunk: int,
) -> None:
    rig = Rig(blocks_per_chunk)
    tokens = conversation(rig, drafts=2, accept=2)
    assert len(tokens) == 47 and rig.stat("drafted_states") > 0
    turn2 = [*tokens, 1, 2, 3]
    # The state at 8 (a prefill step's end) is stored; none reached by accepted drafts is:
    # their attention KV is stored (see below), the state a hit needs at its end is not.
    assert rig.side.lookup("t2", turn2, 0) == 8
    # With the same steps and no drafts the turn would hit at its output's last boundary.
    plain = Rig(blocks_per_chunk)
    plain_tokens = conversation(plain, drafts=0, accept=0)
    assert plain.stat("drafted_states") == 0
    assert plain.side.lookup("t2", [*plain_tokens, 1, 2, 3], 0) == 20


def test_the_attention_kv_of_accepted_drafts_is_stored() -> None:
    """Every full-attention chunk of the output up to its last step's start (43 tokens: what
    that step accepted is never stored, the request finishing after it)."""
    rig = Rig()
    tokens = conversation(rig, drafts=2, accept=2)
    done = rig.side.index.ready_mask(rig.side.keys_for([*tokens, 1])[1])
    assert done == [True] * 10 + [False] * 1, done


def test_the_next_turns_prefill_stores_the_states_its_first_turn_could_not() -> None:
    rig = Rig()
    tokens = conversation(rig, drafts=2, accept=2)
    turn2 = [*tokens, 1, 2, 3, 4, 5, 6]  # 53 tokens: its prompt's last boundary is 52
    assert rig.side.lookup("t2", turn2, 0) == 8
    rig.prefill("t2", turn2)  # recomputed (vLLM's cache reset): no drafts
    rig.side.request_finished("t2")
    assert rig.side.lookup("t3", [*turn2, 9, 9], 0) == 52


def test_a_local_hit_at_a_drafted_boundary_stores_no_state_after_it() -> None:
    """vLLM's own cache keeps the drafted state and may serve it: what a request computes
    on from it is not stored; from a local hit at a prefill boundary it is."""
    rig = Rig()
    tokens = conversation(rig, drafts=2, accept=2)  # boundaries 12, 16, 20, ... drafted
    follow = [*tokens[:16], *range(500, 511)]  # 27 tokens: its prompt ends at 24
    rig.local_hit("from16", follow, 16)
    rig.prefill("from16", follow, start=16)
    assert rig.side.lookup("probe16", [*follow, 1], 0) == 8  # not 24
    other = [*tokens[:8], *range(600, 611)]  # shares the prefill boundary 8: 19 tokens
    rig.local_hit("from8", other, 8)
    rig.prefill("from8", other, start=8)
    assert rig.side.lookup("probe8", [*other, 1], 0) == 16


def test_a_local_hit_before_any_drafted_step_is_trusted() -> None:
    rig = Rig()
    tokens = list(PROMPT) + list(range(200, 210))
    rig.prefill("a", tokens)
    rig.side.request_finished("a")
    rig.local_hit("b", [*tokens[:16], *range(300, 311)], 16)
    rig.prefill("b", [*tokens[:16], *range(300, 311)], start=16)
    assert rig.side.lookup("probe", [*tokens[:16], *range(300, 311), 1], 0) == 24


def test_a_preempted_request_recomputed_by_prefill_stores_its_states_again() -> None:
    rig = Rig()
    tokens = list(PROMPT)
    rig.prefill("r", tokens)
    rig.decode("r", tokens, steps=6, drafts=2, accept=2)  # 29 tokens, 28 computed
    rig.side.preempted("r")
    rig.step("r", tokens, 0, 28, len(PROMPT))  # vLLM recomputes it in one step (align: 28)
    rig.side.request_finished("r")
    assert rig.side.lookup("probe", [*tokens, 1], 0) == 28


def test_drafts_on_a_plain_layout_store_every_output_chunk() -> None:
    """An EAGLE-like drafter without a recurrent group: accepted drafts' chunks are stored
    (before, a step's accepted drafts were never marked valid, and no output chunk past
    the first accepted draft was stored)."""
    layout = KVLayout((CacheGroup("full", BLOCK, ("a0", "eagle.0"), 64),), lookahead=1)
    rig = Rig(layout=layout)
    tokens = list(PROMPT)
    rig.prefill("r", tokens)
    rig.decode("r", tokens, steps=6, drafts=2, accept=1)
    rig.side.request_finished("r")
    assert rig.side.lookup("probe", [*tokens, 1], 0) == (len(tokens) - 1) // BLOCK * BLOCK
