"""What the end-to-end tests share besides fixtures: the engine callable and prompts."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

#: Runs one engine process on a spec (see ``_runner.py``) and returns its result.
Engine = Callable[..., dict[str, Any]]


def shared_prefix_prompts(
    n: int, prefix_len: int, suffix_len: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    """``n`` prompts of random token ids sharing their first ``prefix_len`` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(suffix_len + i)] for i in range(n)]
