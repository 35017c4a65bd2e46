"""kvoffload's :class:`KVLayout` from vLLM's ``KVCacheConfig``: the one place that decides.

:data:`SPEC_TABLE` holds one row per KV cache spec class of vLLM 0.32,
0.33 and 0.34 (``vllm/v1/kv_cache_interface.py``; DeepSeek-V4's layers use these
classes too): what a prefix hit needs from a group of that class, and so
whether kvoffload *serves* it (as a group of some kind, see
:data:`kvoffload.config.layout.GROUP_KINDS`), *skips* it (it holds nothing a
hit could reuse, and vLLM lets a hit go without it: its blocks are neither
stored nor loaded), or *refuses* the model at engine start, naming the group
and the reason. A class without a row (a class a later vLLM adds) is
refused: nothing is served by accident. :data:`SPEC_FIELDS` holds the spec
fields that reorder a page's bytes (0.34's), each with its reason.

vLLM hands the scheduler-side connector a different ``KVCacheConfig`` than
the workers for models whose groups mix page sizes (DeepSeek-V4): a worker's
group is a ``UniformTypeKVCacheSpecs`` of one spec per layer, the
scheduler's is its first layer's spec alone. Both sides must build the same
layout (chunk sizes, CPU slots and the key namespace depend on it), so the
kind comes from the first layer's spec on both sides, and each layer's page
from the ``kv_cache_tensors`` both sides share; a worker checks those pages
against its own per-layer specs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from kvoffload.config.layout import GROUP_KINDS, CacheGroup, KVLayout, Reuse
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

__all__ = [
    "SPEC_FIELDS",
    "SPEC_TABLE",
    "Action",
    "FieldRow",
    "GroupMap",
    "SpecRow",
    "boundary_states",
    "group_map",
    "page_format",
    "spec_row",
    "state_refusal",
]

#: The module whose spec classes the table names; a same-named class elsewhere is unknown.
SPEC_MODULE = "vllm.v1.kv_cache_interface"


class Action(Enum):
    """What kvoffload does with a group of some spec class."""

    SERVE = "serve"
    SKIP = "skip"
    REFUSE = "refuse"


class SpecRow(NamedTuple):
    action: Action
    #: The group kind when served (see ``GROUP_KINDS``), else None.
    kind: str | None
    #: Why, in one line: what a hit at H needs from such a group (and, when replicated, why
    #: every tensor-parallel rank holds the same bytes).
    reason: str
    #: Every tensor-parallel rank holds the same bytes (vLLM does not split the group by
    #: head): one copy of a chunk serves all ranks. False: each rank holds its shard.
    replicated: bool = False


def _serve(kind: str, reason: str, *, replicated: bool = False) -> SpecRow:
    return SpecRow(Action.SERVE, kind, reason, replicated)


#: Why an MLA-family group is the same on every rank, appended to its row's reason.
_LATENT = (
    "; replicated: the latent comes from the layer's input through an unsharded projection "
    "(vLLM's MLA splits the query heads, never the latent), so every rank holds these bytes"
)


def _skip(reason: str) -> SpecRow:
    return SpecRow(Action.SKIP, None, reason)


def _refuse(reason: str) -> SpecRow:
    return SpecRow(Action.REFUSE, None, reason)


#: Spec class name (with ``/variant`` where a field changes the answer) -> decision.
SPEC_TABLE: Mapping[str, SpecRow] = MappingProxyType({
    "FullAttentionSpec": _serve("full", "attends to every earlier token: the whole prefix; a "
        "sliding-window or chunked-local layer promoted to it (hybrid allocator off) keeps "
        "every block too"),
    "FullAttentionSpec/non_causal": _refuse("attends to later tokens too (prefix LM): a "
        "prefix's KV depends on what follows it, so vLLM turns its prefix cache off as well"),
    "SinkFullAttentionSpec": _serve("full", "full attention over the request's blocks; the "
        "static sink sits in blocks of its own, never in a request's"),
    "MLAAttentionSpec": _serve("mla", "one latent per token, attended over the whole prefix"
        + _LATENT, replicated=True),
    "MLAAttentionSpec/compressed": _serve("compressed_mla", "one entry per tokens_per_state "
        "tokens (DeepSeek-V4's C4/C128 caches, its indexer's keys), read over the whole prefix"
        + _LATENT, replicated=True),
    "HiddenStateCacheSpec": _serve("mla", "each token's hidden state, a function of its prefix; "
        "replicated: a layer's output after the all-reduce, the same on every rank",
        replicated=True),
    "SlidingWindowSpec": _serve("sliding", "attends to the last sliding_window tokens only"),
    "SlidingWindowMLASpec": _serve("sliding_mla", "MLA entries needed over the window only "
        "(DeepSeek-V4's SWA cache and compressor states)" + _LATENT, replicated=True),
    "SlidingWindowMLASpec/bounded_replay": _skip("not prefix-cacheable: vLLM recomputes the "
        "window after a hit whose load does not restore it (DeepSeek-V4.1)"),
    "ChunkedLocalAttentionSpec": _serve("chunked_local", "attends within its attention chunk: "
        "the tokens since the current chunk began"),
    "CircularBufferSpec": _skip("a per-request ring of not yet compressed keys, not "
        "prefix-cacheable: vLLM gives a hit a fresh one"),
    "HiSparseHotSpec": _skip("a HiSparse staging buffer, not prefix-cacheable: vLLM rebuilds "
        "it from its source group"),
    "HiSparseResidentSpec": _skip("HiSparse's reclaimable device copies, not prefix-cacheable: "
        "vLLM rebuilds them from the host source group"),
    "EncoderOnlyAttentionSpec": _skip("keeps no KV between steps (vLLM sizes it at 0 bytes)"),
    "MambaSpec": _serve("mamba", "recurrent state (gated DeltaNet, Mamba): a hit needs the one "
        "state taken at its end, which vLLM keeps at block boundaries only with "
        "mamba_cache_mode='align' (refused otherwise, see check_state_spec)"),
    "CrossAttentionSpec": _refuse("the decoder's KV depends on the encoder's input, which "
        "chunk keys do not name; vLLM has no prefix cache for encoder-decoder models either"),
    "RSWASpec": _refuse("a generated token's KV differs between decode (windowed) and "
        "prefill (global), so no stored block is what a later prefill would compute"),
})  # fmt: skip


class FieldRow(NamedTuple):
    #: The field's value that leaves a page as vLLM versions without the field lay it out.
    default: object
    #: Why, in one line: what the field does to the bytes kvoffload copies.
    reason: str


#: Spec fields (vLLM 0.34) that change how a page's bytes are ordered but not which
#: pages a hit needs, or their size: kvoffload copies whole pages byte for byte, so
#: they are served; a value other than the default goes into the key namespace
#: (``GroupMap.page_format``), so an engine that orders its pages otherwise never
#: loads the chunk. A field that changed what a page holds would be a variant row above.
SPEC_FIELDS: Mapping[str, FieldRow] = MappingProxyType({
    "kv_head_major_slots": FieldRow(False, "attention: a page's head slots grouped by KV "
        "head (H2ND) instead of K before V; the same bytes and page size, in another order"),
    "state_alignment": FieldRow(1, "Mamba: each state starts at a multiple of this many "
        "bytes; real_page_size_bytes counts the padding between states, so a chunk copies "
        "every state at its offset, and the offsets differ between alignments"),
})  # fmt: skip


def page_format(spec: KVCacheSpec) -> tuple[tuple[str, object], ...]:
    """The :data:`SPEC_FIELDS` of ``spec`` that are not at their default, by name."""
    return tuple(
        (name, value)
        for name, row in SPEC_FIELDS.items()
        if (value := getattr(spec, name, row.default)) != row.default
    )


def spec_row(spec: KVCacheSpec) -> tuple[str, SpecRow]:
    """The table's row for one (per-layer) spec, and the row's name."""
    cls = type(spec)
    name = cls.__name__
    if cls.__module__ != SPEC_MODULE or name not in SPEC_TABLE:
        known = ", ".join(sorted({row.split("/")[0] for row in SPEC_TABLE}))
        return name, _refuse(
            f"an unknown KV cache spec class ({cls.__module__}.{name}); kvoffload knows {known}"
        )
    if getattr(spec, "non_causal", False):  # any full-attention class can be non-causal
        return f"{name}/non_causal", SPEC_TABLE["FullAttentionSpec/non_causal"]
    if name == "MLAAttentionSpec" and getattr(spec, "tokens_per_state", 1) != 1:
        name += "/compressed"
    if name == "SlidingWindowMLASpec" and getattr(spec, "bounded_replay", False):
        name += "/bounded_replay"
    return name, SPEC_TABLE[name]


class GroupMap(NamedTuple):
    """vLLM's groups as kvoffload sees them."""

    #: The served groups, in vLLM's order.
    layout: KVLayout
    #: vLLM's index of each layout group (skipped groups have none).
    group_ids: tuple[int, ...]
    #: vLLM's index of each skipped group, and why it was skipped.
    skipped: tuple[tuple[int, str], ...]
    #: vLLM's group count: its block id lists have one entry per group.
    num_vllm_groups: int
    #: Served groups' page fields off their defaults (``SPEC_FIELDS``), for the namespace.
    page_format: tuple[tuple[str, object], ...] = ()

    def served_block_ids(self, block_ids: Sequence[Sequence[int]]) -> tuple[Sequence[int], ...]:
        """vLLM's per-group block ids of a request, for the layout's groups only."""
        if len(block_ids) != self.num_vllm_groups:
            raise ConfigError(
                f"vLLM gave block ids for {len(block_ids)} KV cache groups, the layout was "
                f"built for {self.num_vllm_groups}"
            )
        return tuple(block_ids[g] for g in self.group_ids)

    def served_states(self, handed: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """vLLM's ``(group, block id, tokens)`` state hand-offs, in the layout's group indices."""
        ours = {vllm_g: g for g, vllm_g in enumerate(self.group_ids)}
        return [(ours[g], block, tokens) for g, block, tokens in handed if g in ours]


def boundary_states(output: Any) -> dict[str, list[tuple[int, int, int]]]:
    """vLLM's hand-off of the recurrent states a step's forward pass writes, per request.

    ``SchedulerOutput.kv_connector_block_state.boundary_state_offloads`` (vLLM
    0.32 and 0.33); the scheduler side finds the states at a step's ends
    without it, so an older vLLM that lacks it loses nothing else.
    """
    state = getattr(output, "kv_connector_block_state", None)
    handed = getattr(state, "boundary_state_offloads", None)
    return dict(handed) if handed else {}


def _layer_specs(spec: KVCacheSpec) -> dict[str, KVCacheSpec] | None:
    """A worker's per-layer specs of a ``UniformTypeKVCacheSpecs`` group; None for plain specs."""
    if type(spec).__name__ != "UniformTypeKVCacheSpecs":
        return None
    specs: dict[str, KVCacheSpec] = dict(spec.kv_cache_specs)
    return specs


def _tensor_pages(config: KVCacheConfig) -> dict[str, int]:
    """Each layer's page from the tensors both sides share: its smaller stride.

    A block-outermost tensor steps ``layer_stride`` (the page) between layers
    and ``block_stride`` (the packed block) between blocks; a layer-outermost
    one the reverse.
    """
    pages: dict[str, int] = {}
    for tensor in getattr(config, "kv_cache_tensors", None) or ():
        strides = [getattr(tensor, "layer_stride", 0), getattr(tensor, "block_stride", 0)]
        positive = [int(s) for s in strides if s]
        if positive:
            pages.update(dict.fromkeys(tensor.layers, min(positive)))
    return pages


def _pages(
    config: KVCacheConfig, g: int, group: KVCacheGroupSpec, first: KVCacheSpec, kind: str
) -> tuple[int, ...]:
    names = list(group.layer_names)
    if GROUP_KINDS[kind] is Reuse.STATE:  # vLLM pads a state page; only the state is moved
        return (int(first.real_page_size_bytes),) * len(names)
    shared = _tensor_pages(config)
    pages = [shared.get(name, int(first.page_size_bytes)) for name in names]
    if len(set(pages)) == 1:  # one page for all: the spec says it exactly (padding included)
        pages = [int(first.page_size_bytes)] * len(names)
    inner = _layer_specs(group.kv_cache_spec)
    if inner is not None:
        own = [int(inner[name].page_size_bytes) for name in names]
        if own != pages:
            raise ConfigError(
                f"KV cache group {g}: the layers' pages {own} differ from what the scheduler "
                f"side reads from vLLM's kv_cache_tensors {pages}; kvoffload cannot size "
                "its chunks alike on both sides for this layout"
            )
    return tuple(pages)


def _decide(g: int, group: KVCacheGroupSpec) -> tuple[SpecRow, KVCacheSpec]:
    """The row of group ``g`` and the spec both sides see (a worker's first layer's)."""
    spec = group.kv_cache_spec
    inner = _layer_specs(spec)
    first = next(iter(inner.values())) if inner else spec
    if not getattr(group, "enable_kv_transfer", True):
        return _skip("vLLM excludes it from KV transfer (enable_kv_transfer=False)"), first
    if getattr(group, "host_resident", False):
        return _refuse("held in vLLM's host pool (HiSparse), not in a device tensor"), first
    name, row = spec_row(first)
    for layer, other in (inner or {}).items():
        other_name, other_row = spec_row(other)
        if (other_row.action, other_row.kind) != (row.action, row.kind):
            return _refuse(
                f"it mixes {name} ({row.action.value} {row.kind}) with layer {layer!r}'s "
                f"{other_name} ({other_row.action.value} {other_row.kind})"
            ), first
    if row.action is Action.SERVE and not getattr(first, "prefix_cacheable", True):
        return _refuse(f"{name} says it is not prefix-cacheable"), first
    if row.kind == "mamba":
        why = state_refusal(first)
        if why is not None:
            return _refuse(why), first
    return row, first


def state_refusal(spec: Any) -> str | None:
    """Why a recurrent group cannot be served exactly, naming the fix; None if it can.

    A hit at ``H`` needs the state after exactly ``H`` tokens. vLLM keeps one
    at each block boundary it scheduled to only with ``mamba_cache_mode="align"``
    (which ``enable_prefix_caching=True`` turns on); otherwise each request has
    one running state and nothing a hit could restore. With speculative
    decoding (``num_speculative_blocks`` > 0) vLLM moves a state that accepted
    drafts reached into a boundary's block, and that state is not a
    recompute's: the scheduler side stores no such state
    (:mod:`kvoffload.connector._drafts`; proven on a real engine in
    ``tests_e2e/test_speculative_recurrent.py``), so it is served too.
    """
    mode = getattr(spec, "mamba_cache_mode", None)
    if mode != "align":
        return (
            f"a recurrent (Mamba / gated DeltaNet) group needs vLLM to keep a state at each "
            f"block boundary, but mamba_cache_mode is {mode!r}; start vLLM with "
            f'enable_prefix_caching=True and mamba_cache_mode="align" (--enable-prefix-caching '
            f"--mamba-cache-mode align)"
        )
    return None


def _window(kind: str, spec: Any) -> dict[str, int]:
    """The window field of a window kind, read off the spec."""
    if kind in ("sliding", "sliding_mla"):
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return {"sliding_window": int(spec.sliding_window) + extra}
    if kind == "chunked_local":
        return {"attention_chunk_size": int(spec.attention_chunk_size)}
    return {}


def group_map(kv_cache_config: KVCacheConfig, lookahead: int = 0) -> GroupMap:
    """Decide every group of ``kv_cache_config`` (see the module docstring); ``lookahead``
    as :attr:`KVLayout.lookahead` (:func:`~kvoffload.vllm._startup.drafter_lookahead`).

    Raises ``ConfigError`` naming the first refused group and the reason.
    """
    groups, ids, skipped = [], [], []
    fields: dict[str, object] = {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        row, first = _decide(g, group)
        where = f"KV cache group {g} ({type(first).__name__}, {len(group.layer_names)} layers)"
        if row.action is Action.REFUSE:
            raise ConfigError(
                f"KVOffloadConnector cannot offload {where}: {row.reason}. Run this model "
                "without the connector"
            )
        if row.action is Action.SKIP:
            skipped.append((g, row.reason))
            continue
        assert row.kind is not None  # every SERVE row names its kind
        pages = _pages(kv_cache_config, g, group, first, row.kind)
        groups.append(
            CacheGroup(
                kind=row.kind,
                tokens_per_block=int(first.block_size),
                layer_names=tuple(group.layer_names),
                page_bytes=max(pages),
                layer_page_bytes=pages,
                replicated=row.replicated,
                **_window(row.kind, first),
            )
        )
        ids.append(g)
        fields.update(page_format(first))
    if not groups:
        raise ConfigError(
            "KVOffloadConnector: the model has no KV cache group a prefix hit can reuse "
            f"(skipped: {skipped or 'none'}); run it without the connector"
        )
    return GroupMap(
        KVLayout(tuple(groups), lookahead),
        tuple(ids),
        tuple(skipped),
        len(kv_cache_config.kv_cache_groups),
        tuple(sorted(fields.items())),
    )
