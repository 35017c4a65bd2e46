"""A draft model's layers beside the target's (``method: draft_model``), as vLLM 0.32 groups them.

vLLM registers the drafter's attention layers as ``draft_model.<name>`` and
groups them with the target's (measured on vLLM 0.32's CPU build, and held
to vLLM's grouping code by ``tests_e2e/test_spec_kinds.py``):

* beside a target whose layers are all full attention in one group, the
  drafter's full-attention layers join that group, each with its own page
  (vLLM's ``UniformTypeKVCacheSpecs``: one block table, pages of several sizes);
* beside a hybrid target (several groups) each drafter layer spec forms groups
  of its own under the same rules as the target's, with the common page; vLLM
  then requires all drafter layers in one group, so a drafter of more than
  one layer there is refused, as vLLM refuses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError

__all__ = ["DRAFT_PREFIX", "with_draft_model"]

#: vLLM's prefix of the drafter's layer names.
DRAFT_PREFIX = "draft_model."


def with_draft_model(
    layout: KVLayout,
    draft: str | Path | Mapping[str, Any],
    dtype: str = "bfloat16",
    block_size: int = 16,
) -> KVLayout:
    """``layout`` (the target's) with the layers of draft model ``draft`` where vLLM puts them.

    Raises ``ConfigError`` for a drafter vLLM cannot place: one with other
    than full-attention layers, or of several layers beside a hybrid target.
    """
    drafter = layout_from_hf_config(draft, dtype=dtype, block_size=block_size, hybrid=False)
    names = tuple(DRAFT_PREFIX + name for g in drafter.groups for name in g.layer_names)
    pages = tuple(p for g in drafter.groups for p in g.layer_pages)
    tokens = {g.tokens_per_block for g in drafter.groups}
    if len(layout.groups) == 1 and layout.groups[0].kind == "full":
        (target,) = layout.groups
        if tokens != {target.tokens_per_block}:
            raise ConfigError(
                f"the draft model's blocks hold {sorted(tokens)} tokens, the target's "
                f"{target.tokens_per_block}; vLLM keeps them in one group only at one block size"
            )
        all_pages = target.layer_pages + pages
        joined = dataclasses.replace(
            target, layer_names=target.layer_names + names, page_bytes=max(all_pages),
            layer_page_bytes=all_pages,
        )  # fmt: skip
        return KVLayout((joined,))
    if len(names) != 1:
        raise ConfigError(
            f"a draft model of {len(names)} layers beside a hybrid target: vLLM 0.32 splits "
            "its layers over several KV cache groups and refuses to start (all drafting "
            "layers must be in one group); use a one-layer drafter"
        )
    page = max(g.page_bytes for g in layout.groups if g.kind != "mamba")
    per_token = pages[0] // next(iter(tokens))
    if page % per_token:
        raise ConfigError(
            f"cannot unify page sizes: the drafter's {per_token} bytes per token do not divide "
            f"the target's page of {page} bytes"
        )
    own = CacheGroup(kind="full", tokens_per_block=page // per_token, layer_names=names,
                     page_bytes=page)  # fmt: skip
    return KVLayout((*layout.groups, own))
