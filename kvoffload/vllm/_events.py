"""KV events for the CPU tier in vLLM's own terms, so a KV-aware router can match them.

Routers index vLLM's GPU events: llm-d recomputes its keys from ``token_ids``
(in blocks of its own size) and needs a ``parent_block_hash`` it has already
seen; Dynamo needs 64-bit hashes and ``block_size`` equal to the engine's
block size, and chains blocks through their hashes. So one chunk stored in
the CPU tier is announced as vLLM would announce its blocks:

* ``block_hashes``: vLLM's hashes of the chunk's blocks (at the group's block
  size, as ints when vLLM publishes ints), so the CPU copy has the identity
  of the GPU blocks a router already knows;
* ``parent_block_hash``: vLLM's hash of the block before the chunk;
* ``token_ids``: the chunk's tokens; ``block_size``: the group's tokens per
  block (not the chunk's: Dynamo drops events of another block size);
* ``medium="CPU"``; ``lora_id`` / ``lora_name``; ``extra_keys`` per block
  (adapter name, images, salt, embeddings digest) as vLLM builds them;
  ``group_idx`` and the group's spec kind.

Only groups that need the whole prefix (full attention, MLA) are announced,
as vLLM's own offloading connector does: a sliding-window chunk alone says
nothing a router can use. Lower tiers are not announced: the scheduler side
does not learn when a disk or remote write lands, and a remote server evicts
on its own without telling anyone, so a router would be told of chunks that
are gone. A chunk is described when its store (or promotion) is planned,
while the request is alive, announced when the index reports it stored, and
its hashes are kept until the index reports it removed (eviction or reset),
so that ``BlockRemoved`` names the same hashes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvoffload.config.layout import Reuse
from kvoffload.connector._tails import whole_chunks
from kvoffload.manager.results import EventKind, IndexEvent
from kvoffload.messages import TransferOrder
from kvoffload.vllm._layout import GroupMap

__all__ = ["ChunkEvents"]

#: The index's ``storing_mask``: whether each key's store or promotion is in flight.
StoringMask = Callable[[Sequence[bytes]], list[bool]]


@dataclass(slots=True)
class _Chunk:
    """What a router is told of one chunk; ``token_ids`` are dropped once announced."""

    group: int
    hashes: list[Any]
    parent: Any
    token_ids: list[int] | None
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None


class ChunkEvents:
    """Describes chunks of planned orders and turns index events into vLLM's KV events."""

    def __init__(self, groups: GroupMap, blocks_per_chunk: int, kv_cache_config: Any) -> None:
        layout = self.layout = groups.layout
        #: vLLM's index of each of kvoffload's groups (vLLM's groups kvoffload skips have none).
        self.vllm_group = groups.group_ids
        self.bpc = blocks_per_chunk
        self.hash_block_size = int(kv_cache_config.hash_block_size or layout.tokens_per_block[0])
        self.announced_groups = frozenset(
            g for g, group in enumerate(layout.groups) if group.reuse is Reuse.PREFIX
        )
        vllm_groups = kv_cache_config.kv_cache_groups
        specs = [vllm_groups[v].kv_cache_spec for v in self.vllm_group]
        self._kinds = [get_kv_cache_spec_kind(spec).value for spec in specs]
        self._windows = [get_kv_cache_spec_sliding_window(spec) for spec in specs]
        self._pending: dict[bytes, _Chunk] = {}
        self._stored: dict[bytes, _Chunk] = {}

    def describe(
        self, request: Any, order: TransferOrder, block_ids: Any, storing: StoringMask
    ) -> None:
        """Remember what the chunks ``order`` stores or promotes hold, while ``request`` is at hand.

        ``storing(keys)`` tells them from the chunks a load reads from the CPU tier.
        """
        for span in order.spans:
            if span.group not in self.announced_groups:
                continue
            first = list(block_ids[span.group]).index(span.blocks.block_ids[0]) // self.bpc
            whole = whole_chunks(span, self.bpc)  # a tail is no chunk of the engine's blocks
            for i, (key, new) in enumerate(zip(span.keys, storing(span.keys), strict=True)):
                if new and whole[i] and key not in self._pending:
                    chunk = self._chunk(request, span.group, first + i)
                    if chunk is not None:
                        self._pending[key] = chunk

    def _chunk(self, request: Any, group: int, chunk: int) -> _Chunk | None:
        tpb = self.layout.groups[group].tokens_per_block
        per_block = tpb // self.hash_block_size
        blocks = range(chunk * self.bpc, (chunk + 1) * self.bpc)
        hashes = request.block_hashes
        if len(hashes) < blocks[-1] * per_block + per_block:
            return None  # vLLM has not hashed these blocks (cannot happen for computed ones)
        first = blocks[0]
        parent = hashes[first * per_block - 1] if first else None
        lora = request.lora_request
        extra = [
            generate_block_hash_extra_keys(request, b * tpb, (b + 1) * tpb, 0)[0] for b in blocks
        ]
        return _Chunk(
            group=group,
            hashes=[maybe_convert_block_hash(hashes[(b + 1) * per_block - 1]) for b in blocks],
            parent=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=list(request.all_token_ids[first * tpb : (blocks[-1] + 1) * tpb]),
            lora_id=None if lora is None else lora.lora_int_id,
            lora_name=None if lora is None else lora.lora_name,
            extra_keys=to_event_extra_keys(extra),
        )

    def events(self, changes: list[IndexEvent], storing: StoringMask) -> list[KVCacheEvent]:
        """vLLM events for ``changes``; ``storing(keys)`` says which stores are still in flight."""
        out: list[KVCacheEvent] = []
        for change in changes:
            if change.kind is EventKind.STORED:
                chunk = self._pending.pop(change.key, None)
                if chunk is not None:
                    out.append(self._stored_event(chunk))
                    chunk.token_ids = None
                    self._stored[change.key] = chunk
            else:
                chunk = self._stored.pop(change.key, None)
                if chunk is not None:
                    group = self.vllm_group[chunk.group]
                    out.append(BlockRemoved(chunk.hashes, MEDIUM_CPU, group_idx=group))
        if self._pending:  # a failed store leaves its description behind: drop it
            keys = list(self._pending)
            for key, busy in zip(keys, storing(keys), strict=True):
                if not busy:
                    del self._pending[key]
        return out

    def _stored_event(self, chunk: _Chunk) -> BlockStored:
        assert chunk.token_ids is not None  # announced once, from its description
        return BlockStored(
            block_hashes=chunk.hashes,
            parent_block_hash=chunk.parent,
            token_ids=chunk.token_ids,
            block_size=self.layout.groups[chunk.group].tokens_per_block,
            lora_id=chunk.lora_id,
            medium=MEDIUM_CPU,
            lora_name=chunk.lora_name,
            extra_keys=chunk.extra_keys,
            group_idx=self.vllm_group[chunk.group],
            kv_cache_spec_kind=self._kinds[chunk.group],
            kv_cache_spec_sliding_window=self._windows[chunk.group],
        )

    def __len__(self) -> int:
        """Chunks described or announced and not yet removed (bounded by the CPU tier)."""
        return len(self._pending) + len(self._stored)
