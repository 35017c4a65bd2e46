"""vLLM's recurrent state (Mamba, gated DeltaNet) in ``mamba_cache_mode="align"``, for the stand-in.

A recurrent layer keeps one running state, not a KV entry per token: a
forward pass over tokens ``[start, stop)`` writes the state after ``stop``
tokens into the one block that holds token ``stop - 1``. So a block holds the
state at its end only if a step ended exactly there; align mode makes every
prefill step but the prompt's last end on a block boundary, and one step end
at the last boundary before the prompt's final token (the state a later hit
of the same prompt resumes from). Blocks between are never written (vLLM's
null block), and only the block a step ends in is allocated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.errors import ConfigError

__all__ = ["aligned_stop", "state_block_size", "state_key"]


def state_block_size(layout: KVLayout) -> int | None:
    """The block size of the layout's state groups (vLLM's ``block_size``), ``None`` if none."""
    sizes = {g.tokens_per_block for g in layout.groups if g.reuse is Reuse.STATE}
    if len(sizes) > 1:
        raise ConfigError(f"state groups of different block sizes {sorted(sizes)}: vLLM has one")
    return sizes.pop() if sizes else None


def aligned_stop(layout: KVLayout, start: int, stop: int, num_prompt: int) -> int:
    """Where a step from ``start`` that could run to ``stop`` ends (``start``: not this step).

    vLLM's ``_mamba_block_aligned_split``: with a state group of block ``B``,
    a prefill step that does not finish the prompt ends on a multiple of
    ``B``, and one ends at ``(num_prompt - 1) // B * B``, where the state a
    hit of the same prompt needs is taken. Steps past the prompt are not split.
    """
    block = state_block_size(layout)
    if block is None or start >= num_prompt:
        return stop
    keep = (num_prompt - 1) // block * block
    if start < keep < stop:
        return keep
    if stop >= num_prompt:
        return stop  # the prompt's last step
    return max(start, stop // block * block)


def state_key(hashes: Sequence[bytes], tokens: Sequence[int], stop: int, block: int) -> bytes:
    """What the state after ``stop`` tokens is a function of, for :class:`KVPages` to write.

    At a block boundary it is that block's hash, the name a hit and the GPU
    prefix cache know it by; inside a block (the prompt's last step) the
    hash before it and the tokens since.
    """
    full, rest = divmod(stop, block)
    if not rest:
        return hashes[full - 1]
    head = hashes[full - 1] if full else b""
    tail = np.asarray(tokens[full * block : stop], dtype="<i8").tobytes()
    return hashlib.blake2b(b"state" + head + tail, digest_size=16).digest()
