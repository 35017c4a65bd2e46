"""A one-line fix of vLLM 0.32, applied in the engine's process: a draft model's own KV cache group.

Imported through a runner spec's ``preload`` (before the engine starts). vLLM
0.32's ``GPUModelRunner._build_attention_metadata`` (the CPU runner inherits
it) hands the drafter the common attention metadata of the first KV cache
group unless the drafter is one of ``EagleProposer``, ``DFlashProposer``,
``Gemma4Proposer`` or ``ExtractHiddenStatesProposer``, which are handed their
own group's (``drafter.kv_cache_gid``). ``DraftModelProposer`` is not in that
list, so beside a hybrid target, where the draft model's layer has a group of
its own (not the first), it writes and reads its KV with the first group's
block table and slot mapping: into pages that other groups' blocks hold,
among them blocks vLLM's prefix cache keeps and blocks a request is using.

The fix puts ``DraftModelProposer`` on that list. The list is a tuple written
in the method, so the module's name ``ExtractHiddenStatesProposer`` (used
there, and otherwise only in assertions and in the construction of that
proposer, which these tests never select) is replaced by a class that
instances of either class satisfy.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.worker import gpu_model_runner

_EXTRACT = gpu_model_runner.ExtractHiddenStatesProposer


class _Either(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (_EXTRACT, DraftModelProposer))


gpu_model_runner.ExtractHiddenStatesProposer = _Either(  # type: ignore[misc]
    "ExtractHiddenStatesOrDraftModelProposer", (), {}
)
