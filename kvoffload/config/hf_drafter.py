"""A drafter's layers beside the target's, where vLLM 0.32 puts them, and what its KV reads ahead.

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

An EAGLE head (``eagle``, ``eagle3``) is registered under the target's own
names, ``model.layers.{N + i}.self_attn.attn`` after a target of ``N``
layers, and its layers join the target's full-attention group. Its KV at a
position reads the token after it, so the layout gets a lookahead of 1
(``KVLayout.lookahead``: every chunk key names that token). An MTP drafter
(``mtp``) is the target's own: its layers come from the target's config in
each family's shape and are grouped with the target's, and a multi-module
MTP reads as many tokens ahead as it drafts (:mod:`kvoffload.config._hf_mtp`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from kvoffload.config._hf_mtp import MtpLayers, mtp_layers
from kvoffload.config.hf_layout import layout_from_hf_config, load_hf_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError

__all__ = [
    "DRAFTERS",
    "DRAFT_PREFIX",
    "SPECULATIVE_METHODS",
    "drafter_layers",
    "with_draft_model",
    "with_drafter_layer",
    "with_eagle_head",
    "with_mtp",
]

#: vLLM's prefix of the drafter's layer names.
DRAFT_PREFIX = "draft_model."
#: ``kvoffload plan --speculative-method``: vLLM's methods with drafter KV that plan knows.
SPECULATIVE_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
#: The drafters of the demo and the replay (``--drafter``): one layer each.
DRAFTERS = ("none", "draft_model", "eagle")


def _eagle_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def drafter_layers(layout: KVLayout, target_layers: Collection[str]) -> list[list[str]]:
    """Per group of ``layout``, its layers that are not the target's (the drafter's)."""
    return [[n for n in g.layer_names if n not in target_layers] for g in layout.groups]


def _with_layers(group: CacheGroup, names: tuple[str, ...], pages: tuple[int, ...]) -> CacheGroup:
    """``group`` with the drafter's layers ``names`` (of pages ``pages``) after its own."""
    all_pages = group.layer_pages + pages
    return dataclasses.replace(
        group,
        layer_names=group.layer_names + names,
        page_bytes=max(all_pages),
        layer_page_bytes=all_pages,
    )


def _join_full(
    layout: KVLayout, names: tuple[str, ...], pages: tuple[int, ...], tokens: int, lookahead: int
) -> KVLayout:
    """``layout`` with layers ``names`` (pages ``pages``) in its first full-attention group."""
    full = [i for i, g in enumerate(layout.groups) if g.kind == "full"]
    if not full:
        raise ConfigError(
            "an EAGLE-like drafter beside a target without full-attention layers: vLLM puts "
            "the head's layers in the target's full-attention group, and this target has none"
        )
    target = layout.groups[full[0]]
    if tokens != target.tokens_per_block:
        raise ConfigError(
            f"the drafter's blocks hold {tokens} tokens, the target's full-attention group's "
            f"{target.tokens_per_block}; vLLM keeps them in one group only at one block size"
        )
    if len(layout.groups) > 1 and set(pages) != {target.page_bytes}:
        raise ConfigError(
            f"an EAGLE head beside a hybrid target is placed only at the target's page of "
            f"{target.page_bytes} bytes (vLLM's hybrid allocator unifies page sizes by block "
            f"size, which would take it out of the group); this head's pages: {sorted(set(pages))}"
        )
    joined = _with_layers(target, names, pages)
    groups = tuple(joined if i == full[0] else g for i, g in enumerate(layout.groups))
    return KVLayout(groups, lookahead)


def with_eagle_head(
    layout: KVLayout,
    target: str | Path | Mapping[str, Any],
    head: str | Path | Mapping[str, Any],
    dtype: str = "bfloat16",
    block_size: int = 16,
    *,
    tensor_parallel_size: int = 1,
) -> KVLayout:
    """``layout`` (of ``target``) with the layers of EAGLE head ``head`` in the target's
    full-attention group, named as vLLM names them, and a lookahead of 1 (one rank's pages
    at ``tensor_parallel_size``, as the target's)."""
    layers = load_hf_config(target).get("num_hidden_layers")
    if type(layers) is not int or layers < 1:
        raise ConfigError("the target's config has no num_hidden_layers to name the head's after")
    drafter = layout_from_hf_config(
        head,
        dtype=dtype,
        block_size=block_size,
        hybrid=False,
        tensor_parallel_size=tensor_parallel_size,
    )
    pages = tuple(p for g in drafter.groups for p in g.layer_pages)
    tokens = {g.tokens_per_block for g in drafter.groups}
    if len(tokens) > 1 or any(g.kind != "full" for g in drafter.groups):
        raise ConfigError("an EAGLE head of other than full-attention layers: vLLM has none")
    names = tuple(_eagle_name(layers + i) for i in range(len(pages)))
    return _join_full(layout, names, pages, tokens.pop(), lookahead=1)


def with_drafter_layer(layout: KVLayout, drafter: str) -> KVLayout:
    """``layout`` with one drafter layer (``drafter``: one of :data:`DRAFTERS`) in its first
    full-attention group, of a target layer's page: the demo's and the replay's drafter.
    ``eagle`` names it after the target's layers, as vLLM does, with a lookahead of 1."""
    if drafter == "none":
        return layout
    full = next((g for g in layout.groups if g.kind == "full"), None)
    if full is None:
        raise ConfigError(f"--drafter {drafter}: the layout has no full-attention group")
    if drafter == "eagle":
        name, lookahead = _eagle_name(len(layout.layer_names)), 1
    else:
        name, lookahead = DRAFT_PREFIX + _eagle_name(0), 0
    page = full.layer_pages[0]
    return _join_full(layout, (name,), (page,), full.tokens_per_block, lookahead)


def with_draft_model(
    layout: KVLayout,
    draft: str | Path | Mapping[str, Any],
    dtype: str = "bfloat16",
    block_size: int = 16,
    tensor_parallel_size: int = 1,
) -> KVLayout:
    """``layout`` (the target's) with the layers of draft model ``draft`` where vLLM puts them.

    ``tensor_parallel_size``: one rank's layers, as the target's (vLLM runs the drafter at
    the target's tensor parallelism). Raises ``ConfigError`` for a drafter vLLM cannot
    place: one with other than full-attention layers, or of several layers beside a hybrid
    target.
    """
    drafter = layout_from_hf_config(
        draft,
        dtype=dtype,
        block_size=block_size,
        hybrid=False,
        tensor_parallel_size=tensor_parallel_size,
    )
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
        return KVLayout((_with_layers(target, names, pages),))
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
    own = CacheGroup(
        kind="full", tokens_per_block=page // per_token, layer_names=names, page_bytes=page
    )
    return KVLayout((*layout.groups, own))


def with_mtp(
    target: str | Path | Mapping[str, Any],
    num_speculative_tokens: int | None = None,
    *,
    dtype: str = "bfloat16",
    block_size: int = 16,
    hybrid: bool | None = None,
    tensor_parallel_size: int = 1,
) -> tuple[KVLayout, MtpLayers]:
    """The layout of ``target`` served with its own MTP modules (``method: mtp``): their layers
    grouped with the target's, as vLLM groups them, and their lookahead; and what they are.
    ``ConfigError`` for a family whose MTP is not planned, or a config without MTP layers."""
    mtp = mtp_layers(load_hf_config(target), num_speculative_tokens)
    layout = layout_from_hf_config(
        target,
        dtype=dtype,
        block_size=block_size,
        hybrid=hybrid,
        tensor_parallel_size=tensor_parallel_size,
        more_layers=mtp.layers,
        speculative_tokens=mtp.num_speculative_tokens,
    )
    return dataclasses.replace(layout, lookahead=mtp.lookahead), mtp
