"""The KV cache layout of a model: its groups, each with its own block size.

A *group* is a set of layers that share one block table in the engine: one
attention kind. Hybrid models (Gemma-4's sliding-window and full-attention
layers, DeepSeek-V4's compressed and sliding-window MLA groups,
Mamba+attention) have several groups whose ``tokens_per_block`` differ, which
is why kvoffload sizes chunks in blocks per group rather than in tokens. The
layers of one group usually have one page size; DeepSeek-V4's packed groups
mix layers of different page sizes (``layer_page_bytes``).

A *state* group (Mamba, gated DeltaNet: :attr:`Reuse.STATE`) holds no tokens:
each of its blocks is one recurrent state, the one after exactly
``(i + 1) * tokens_per_block`` tokens for block ``i``, and ``page_bytes`` is
one layer's state (conv and SSM together, without the engine's padding). A
chunk of a state group is the single state at the chunk's end, so it is one
block whatever ``blocks_per_chunk`` is, and a hit can only land where such a
state was stored.

Everything here validates itself on construction, so code further down can
trust a ``KVLayout`` without re-checking it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from kvoffload._checks import checked_int
from kvoffload.errors import ConfigError

__all__ = ["GROUP_KINDS", "WINDOW_FIELDS", "CacheGroup", "KVLayout", "Reuse"]


class Reuse(Enum):
    """What a prefix hit at ``H`` tokens needs from a group: the one distinction hits care about."""

    #: Every token up to ``H`` (full attention, MLA, compressed MLA): the whole prefix.
    PREFIX = "prefix"
    #: Only the tokens inside the window that ends at ``H`` (sliding window, chunked local).
    WINDOW = "window"
    #: One state snapshot taken exactly at ``H`` (Mamba, gated DeltaNet).
    STATE = "state"


#: Group kinds and what a hit needs from each (DESIGN.md, "group kinds"):
#: ``compressed_mla`` keeps one entry per several tokens (DeepSeek-V4's C4/C128
#: caches and its indexer's keys) yet, like MLA, is attended over the whole
#: prefix; ``sliding_mla`` is a sliding window over MLA entries (DeepSeek-V4's
#: SWA cache and compressor states); ``chunked_local`` attends within its
#: attention chunk only (Llama-4).
GROUP_KINDS: Mapping[str, Reuse] = MappingProxyType(
    {
        "full": Reuse.PREFIX,
        "mla": Reuse.PREFIX,
        "compressed_mla": Reuse.PREFIX,
        "sliding": Reuse.WINDOW,
        "sliding_mla": Reuse.WINDOW,
        "chunked_local": Reuse.WINDOW,
        "mamba": Reuse.STATE,
    }
)

#: The field that sizes the window of each window kind: it must be set for them, and only them.
WINDOW_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "sliding": "sliding_window",
        "sliding_mla": "sliding_window",
        "chunked_local": "attention_chunk_size",
    }
)


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One KV cache group: layers sharing a block table.

    ``page_bytes`` is the size of one block of one layer, K and V together,
    exactly as the engine allocates it (padding included), except for a state
    group: one layer's state without the engine's padding (see the module
    docstring). When the layers' pages differ (DeepSeek-V4 packs MLA, indexer
    and compressor layers into one group), ``layer_page_bytes`` gives each
    layer's page in layer order and ``page_bytes`` is the largest of them.

    ``replicated`` says that every tensor-parallel rank holds the same bytes
    for this group (an MLA latent: vLLM does not split it by head), so a
    chunk is stored once for all ranks; otherwise each rank holds its own
    shard (KV heads split across ranks) and stores it under its own key.
    """

    kind: str
    tokens_per_block: int
    layer_names: tuple[str, ...]
    page_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    layer_page_bytes: tuple[int, ...] | None = None
    replicated: bool = False

    def __post_init__(self) -> None:
        owner = f"CacheGroup(kind={self.kind!r})"
        if self.kind not in GROUP_KINDS:
            raise ConfigError(
                f"CacheGroup: kind must be one of {', '.join(GROUP_KINDS)}, got {self.kind!r}"
            )
        checked_int(f"{owner}: tokens_per_block", self.tokens_per_block)
        checked_int(f"{owner}: page_bytes", self.page_bytes)
        names: object = self.layer_names
        if isinstance(names, str) or not isinstance(names, tuple | list):
            raise ConfigError(f"{owner}: layer_names must be a tuple of str, got {names!r}")
        if not names:
            raise ConfigError(f"{owner}: a group needs at least one layer")
        if not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"{owner}: layer names must be non-empty str, got {names!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"{owner}: duplicate layer names in {names!r}")
        object.__setattr__(self, "layer_names", tuple(names))
        if not isinstance(self.replicated, bool):
            raise ConfigError(f"{owner}: replicated must be a bool, got {self.replicated!r}")
        for name in ("sliding_window", "attention_chunk_size"):
            kinds = [kind for kind, field in WINDOW_FIELDS.items() if field == name]
            value = getattr(self, name)
            if self.kind in kinds:
                checked_int(f"{owner}: {name}", value)
            elif value is not None:
                raise ConfigError(
                    f"{owner}: {name} is only for kind {' or '.join(map(repr, kinds))}, "
                    f"got {value!r}"
                )
        self._check_layer_pages(owner)

    def _check_layer_pages(self, owner: str) -> None:
        pages: object = self.layer_page_bytes
        if pages is None:
            return
        if not isinstance(pages, tuple | list) or len(pages) != len(self.layer_names):
            raise ConfigError(
                f"{owner}: layer_page_bytes must give one page size per layer "
                f"({len(self.layer_names)}), got {pages!r}"
            )
        sizes = tuple(checked_int(f"{owner}: layer_page_bytes", p) for p in pages)
        if self.page_bytes != max(sizes):
            raise ConfigError(
                f"{owner}: page_bytes must be the largest of layer_page_bytes "
                f"({max(sizes)}), got {self.page_bytes}"
            )
        # One page size for every layer is the plain case: keep one representation of it.
        object.__setattr__(self, "layer_page_bytes", sizes if len(set(sizes)) > 1 else None)

    @property
    def reuse(self) -> Reuse:
        """What a prefix hit needs from this group (see :class:`Reuse`)."""
        return GROUP_KINDS[self.kind]

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def layer_pages(self) -> tuple[int, ...]:
        """Each layer's page bytes, in layer order."""
        return self.layer_page_bytes or (self.page_bytes,) * self.num_layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers of the group."""
        return sum(self.layer_pages)

    def chunk_blocks(self, blocks_per_chunk: int) -> int:
        """Engine blocks one chunk holds: ``blocks_per_chunk``, or 1 for a state group.

        A state chunk keeps only the state at its end: the states inside it
        are never a hit point (hits land on chunk boundaries of every group).
        """
        return 1 if self.reuse is Reuse.STATE else blocks_per_chunk

    def chunk_first_block(self, chunk: int, blocks_per_chunk: int) -> int:
        """Index, in a request's block table, of the first engine block chunk ``chunk`` holds."""
        return (chunk + 1) * blocks_per_chunk - self.chunk_blocks(blocks_per_chunk)

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of one chunk of this group: every layer's pages of its blocks."""
        return self.block_bytes * self.chunk_blocks(blocks_per_chunk)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """An ordered tuple of groups; the group index is part of every chunk key."""

    groups: tuple[CacheGroup, ...]
    #: Tokens after a position that its KV depends on too: 0, except with an EAGLE-like
    #: drafter (EAGLE, EAGLE-3, MTP), whose layers read the target's hidden state at a
    #: position with the embedding of the token after it (vLLM's
    #: ``num_prefill_lookahead_tokens``: 1, or the drafted tokens of a multi-module MTP).
    #: A chunk's key then names these tokens too (:func:`~kvoffload.keys.extend_prefix_keys`).
    lookahead: int = 0

    def __post_init__(self) -> None:
        checked_int("KVLayout lookahead", self.lookahead, minimum=0)
        groups = self.groups
        if not isinstance(groups, tuple | list) or not groups:
            raise ConfigError(f"KVLayout needs at least one CacheGroup, got {groups!r}")
        for i, group in enumerate(groups):
            if not isinstance(group, CacheGroup):
                raise ConfigError(f"KVLayout group {i} must be a CacheGroup, got {group!r}")
        seen: dict[str, int] = {}
        for i, group in enumerate(groups):
            for name in group.layer_names:
                if name in seen:
                    raise ConfigError(
                        f"KVLayout: layer {name!r} is in group {seen[name]} and group {i}; "
                        "a layer belongs to exactly one group"
                    )
                seen[name] = i
        object.__setattr__(self, "groups", tuple(groups))

    @property
    def tokens_per_block(self) -> tuple[int, ...]:
        return tuple(g.tokens_per_block for g in self.groups)

    @property
    def has_state(self) -> bool:
        """Whether a group holds recurrent states (:attr:`Reuse.STATE`)."""
        return any(g.reuse is Reuse.STATE for g in self.groups)

    @property
    def state_groups(self) -> frozenset[int]:
        """Indexes of the groups that hold recurrent states."""
        return frozenset(i for i, g in enumerate(self.groups) if g.reuse is Reuse.STATE)

    @property
    def replicated(self) -> bool:
        """Whether every group is the same on every tensor-parallel rank (an MLA model):
        then a chunk is one copy for all ranks, in every tier (see ``CacheGroup``)."""
        return all(g.replicated for g in self.groups)

    @property
    def is_uniform(self) -> bool:
        """Whether every group has the same ``tokens_per_block``."""
        return len(set(self.tokens_per_block)) == 1

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(name for g in self.groups for name in g.layer_names)

    def group_of(self, layer_name: str) -> int:
        """Index of the group holding ``layer_name``."""
        for i, group in enumerate(self.groups):
            if layer_name in group.layer_names:
                return i
        raise ConfigError(f"layer {layer_name!r} is in no group of this layout")
