"""Speculative decoding beside a recurrent group: store only states no accepted draft moved.

vLLM (0.32, ``mamba_cache_mode="align"``) verifies a step's draft tokens in one
forward pass whose kernel writes the state after each draft position into the
request's trailing speculative blocks; after the step it copies the state
after the last accepted token into the block of a block boundary the accepted
tokens crossed (``postprocess_mamba``). That state is not the one a recompute,
a prefill through the same tokens, gives: with an MTP layer that agrees with
its target, vLLM's own prefix cache resumed a second turn at such a boundary
and generated other tokens than a recompute of it
(``tests_e2e/test_speculative_recurrent.py``). A state at a boundary that a
step without draft tokens reached (a prefill step) is a recompute's. So:

* a step that verifies drafts marks the boundaries it may reach,
  ``(computed, computed + scheduled]``, *drafted* (``RequestState.drafted``);
  no state there is stored (:meth:`~._retention.Retention.select`). The
  attention (and MTP) KV of the accepted drafts is a recompute's: the next
  step marks those tokens valid, so their chunks are stored, and a hit needs
  the state at its end, so it never lands on a drafted boundary;
* vLLM's own prefix cache keeps the states at drafted boundaries and may hand
  one to a later request as its local hit: the boundaries drafted steps
  reached are fingerprinted (their tokens), and a request computed on from a
  local hit at one of them stores no state from there on (every later state
  is computed from it).

A multi-turn conversation loses nothing it could use: the next turn's prompt
holds the previous output, its prefill recomputes it, and its prefill
boundaries are stored then.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.connector._request import RequestState, StepRequest, add_range, covered

__all__ = ["DraftedStates", "fingerprint"]

#: Drafted boundaries remembered for the local-hit check, newest kept: vLLM's cache holds at
#: most one state per engine block, far fewer than this on any engine the connector serves.
MAX_REMEMBERED = 1 << 16


def fingerprint(token_ids: Sequence[int], tokens: int) -> bytes:
    """The first ``tokens`` token ids, hashed: which prefix a boundary ends (vLLM's cache
    keys more than tokens; matching tokens alone can only keep more states unstored)."""
    data = np.asarray(token_ids[:tokens], dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


class DraftedStates:
    """Per engine: which boundaries drafted steps reached; per request, what that rules out."""

    def __init__(self, layout: KVLayout) -> None:
        blocks = [g.tokens_per_block for g in layout.groups if g.reuse is Reuse.STATE]
        #: Tokens between the boundaries a state group keeps (0: no state group).
        self.block = math.gcd(*blocks) if blocks else 0
        #: Fingerprints of boundaries a drafted step reached, oldest first.
        self.reached: OrderedDict[bytes, None] = OrderedDict()

    def note(self, req: RequestState, step: StepRequest) -> None:
        """Fold ``step`` into ``req`` before its stores are chosen (every step of every request).

        Marks the tokens the previous step computed beyond its own end (drafts it
        accepted) valid, and records what :mod:`this module <._drafts>` rules out.
        """
        computed, tokens = step.computed, step.token_ids
        before = req.last_computed
        if before is not None and before <= computed:
            if req.last_drafted:  # only a step that verified drafts computes past its end
                req.mark_valid(before, min(computed, len(tokens)))  # its accepted drafts
                if self.block:
                    self._remember(tokens, before, min(computed, len(tokens)))
        elif (  # a first step (or a restart) computed on from vLLM's state at a drafted one
            self.reached
            and 0 < computed == req.local_hit
            and fingerprint(tokens, computed) in self.reached
        ):
            add_range(req.drafted, computed, sys.maxsize)
        drafts = step.drafts
        if drafts and self.block:
            add_range(req.drafted, computed + 1, computed + step.scheduled + 1)
        req.last_computed, req.last_drafted = computed, drafts > 0

    def _remember(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """Fingerprint the boundaries in ``(start, stop]``: a drafted step reached them."""
        block, reached = self.block, self.reached
        for boundary in range((start // block + 1) * block, stop + 1, block):
            key = fingerprint(tokens, boundary)
            reached[key] = None
            reached.move_to_end(key)
            if len(reached) > MAX_REMEMBERED:
                reached.popitem(last=False)

    @staticmethod
    def moved(req: RequestState, boundary: int) -> bool:
        """Whether the state after ``boundary`` tokens may not be a recompute's."""
        return covered(req.drafted, boundary, boundary + 1)
