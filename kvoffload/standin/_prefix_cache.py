"""vLLM's GPU prefix cache as the stand-in engine needs it: blocks, hits, eviction order.

One pool of ``num_blocks`` block ids serves every group, as in vLLM (the
groups of a hybrid model share one page size); block 0 is the null block,
never handed out. A block whose tokens are computed is *cached* under its
group and block hash, so a later request with the same prefix reuses it.
When its last request frees it, it joins the end of the *free queue* and
stays cached until the queue's head reaches it: allocation takes blocks
from the head, evicting what they cached. That is vLLM's ``BlockPool``:
least recently freed first. A request frees its blocks tail first
(``reversed``), so a chain's tail is evicted before its head.

Which blocks a hit needs is the scheduler's own rule
(:func:`kvoffload.connector._hits.needed_tokens`): everything before the hit
point for full attention, the window before it for a sliding window, and
whatever a new group kind declares there; blocks a group does not need
are vLLM's null block. Hits land on multiples of every group's block size.
A recurrent state group gets one block per step, the one the step ends in
(:mod:`kvoffload.standin._state`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.connector._hits import needed_tokens
from kvoffload.connector._spans import NULL_BLOCK
from kvoffload.errors import ProtocolError

__all__ = ["NULL_BLOCK", "PrefixCache"]

Table = list[list[int]]


class PrefixCache:
    """vLLM's block pool and prefix cache over ``layout`` (see the module docstring)."""

    def __init__(self, layout: KVLayout, num_blocks: int, *, caching: bool = True) -> None:
        self.layout = layout
        #: vLLM's ``enable_prefix_caching``: without it no block is cached, so nothing is hit.
        self.caching = caching
        self.tokens_per_block = layout.tokens_per_block
        self.alignment = math.lcm(*self.tokens_per_block)
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, tuple[int, bytes]] = {}
        self._cached: dict[tuple[int, bytes], int] = {}
        #: Cached blocks reused by an allocation (vLLM's prefix-cache evictions).
        self.evictions = 0
        #: States cached in this step: their forward pass has not run yet (:meth:`new_step`).
        self._states_this_step: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now, cached ones included."""
        return len(self._free)

    # -- hits ------------------------------------------------------------------------
    def longest_hit(self, hashes: Sequence[Sequence[bytes]], num_tokens: int) -> tuple[int, Table]:
        """vLLM's ``get_computed_blocks``: the longest cached prefix and its blocks per group.

        ``hashes[g]`` are the block hashes of group ``g``'s full blocks. The
        hit leaves at least one token to compute; a group's blocks it does
        not need are :data:`NULL_BLOCK`.
        """
        align, tpb = self.alignment, self.tokens_per_block
        if not self.caching:
            return 0, [[] for _ in tpb]
        top = (num_tokens - 1) // align * align
        found = [
            [self._cached.get((g, h)) for h in hashes[g][: top // tpb[g]]] for g in range(len(tpb))
        ]
        hit = top
        for g, group in enumerate(self.layout.groups):
            if needed_tokens(group, 0, top)[0] == 0:  # needs every block: the cached run caps it
                run = found[g].index(None) if None in found[g] else len(found[g])
                hit = min(hit, run * tpb[g] // align * align)
        while hit > 0 and not self._servable(found, hit):
            hit -= align
        table: Table = []
        for g, group in enumerate(self.layout.groups):
            first = needed_tokens(group, 0, hit)[0] // tpb[g]
            table.append(
                [
                    found[g][b] or NULL_BLOCK if b >= first else NULL_BLOCK
                    for b in range(hit // tpb[g])
                ]
            )
        return hit, table

    def _servable(self, found: Sequence[Sequence[int | None]], hit: int) -> bool:
        for g, group in enumerate(self.layout.groups):
            tpb = self.tokens_per_block[g]
            first = needed_tokens(group, 0, hit)[0] // tpb
            if None in found[g][first : hit // tpb]:
                return False
        return True

    # -- blocks of one request ------------------------------------------------------------
    def allocate(self, table: Table, hit: Table | None, computed: int, total: int) -> bool:
        """Grow a request's ``table`` to hold ``total`` tokens; ``False`` (nothing changed) if
        the pool is short.

        ``hit`` are the cached blocks of a new request's hit, taken over.
        Blocks wholly before what ``computed`` tokens need are null, hit
        blocks there included (a load beyond the hit moved the window on).
        A hit on a state another request computes in this step is refused as
        vLLM's ``MambaManager`` refuses it (as if the pool were short): the
        state is copied into the running block before the forward pass writes it.
        """
        if hit is not None and any(b in self._states_this_step for ids in hit for b in ids[-1:]):
            return False
        plans = []
        fresh = reused = 0
        for g, group in enumerate(self.layout.groups):
            tpb = self.tokens_per_block[g]
            skipped = needed_tokens(group, 0, computed)[0] // tpb
            base = (
                table[g]
                if hit is None
                else [b if i >= skipped else NULL_BLOCK for i, b in enumerate(hit[g])]
            )
            stop = -(-total // tpb)
            plans.append((base, skipped, stop))
            new = max(0, stop - max(len(base), skipped))
            if group.reuse is Reuse.STATE:
                fresh += min(new, 1) + self._loads_state(len(base), skipped, computed, stop)
            else:
                fresh += new
            if hit is not None:
                reused += sum(1 for b in base if b and not self._refs[b])
        if fresh + reused > len(self._free):
            return False
        for g, (base, skipped, stop) in enumerate(plans):
            if hit is not None:
                self._take_cached(base)
                table[g] = base
            ids = table[g]
            ids += [NULL_BLOCK] * max(0, min(skipped, stop) - len(ids))
            if self.layout.groups[g].reuse is Reuse.STATE:  # the step's state: its last block
                if self._loads_state(len(ids), skipped, computed, stop):
                    ids += self._take(1)
                ids += [NULL_BLOCK] * max(0, stop - 1 - len(ids))
            ids += self._take(stop - len(ids))
        return True

    @staticmethod
    def _loads_state(held: int, skipped: int, computed: int, stop: int) -> bool:
        """Whether a state group needs a block for a loaded state besides the step's last one.

        vLLM's ``allocate_external_computed_blocks``: a request whose
        ``computed`` tokens end past its ``held`` blocks had them loaded, and
        the state after them needs the block they end in, at ``skipped``.
        """
        return computed > 0 and held <= skipped < stop - 1

    def cache(self, table: Table, hashes: Sequence[Sequence[bytes]], num_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_tokens`` (vLLM's ``cache_blocks``)."""
        if not self.caching:
            return
        for g, ids in enumerate(table):
            stop = min(num_tokens // self.tokens_per_block[g], len(ids), len(hashes[g]))
            for b in range(stop):
                block = ids[b]
                if block == NULL_BLOCK or block in self._hash_of:
                    continue
                name = (g, hashes[g][b])
                if name not in self._cached:  # a twin computed first keeps the entry
                    self._cached[name] = block
                    self._hash_of[block] = name
                    if self.layout.groups[g].reuse is Reuse.STATE:
                        self._states_this_step.add(block)

    def new_step(self) -> None:
        """vLLM's ``new_step_starts``: the last step's states are computed now."""
        self._states_this_step.clear()

    def remove_skipped(self, table: Table, computed: int) -> None:
        """Free the blocks a group no longer needs once ``computed`` tokens are done (windows)."""
        for g, group in enumerate(self.layout.groups):
            ids = table[g]
            first = min(needed_tokens(group, 0, computed)[0] // self.tokens_per_block[g], len(ids))
            removed = []
            for b in range(first - 1, -1, -1):
                if ids[b] == NULL_BLOCK and group.reuse is Reuse.STATE:
                    continue  # states of earlier steps sit between null blocks
                if ids[b] == NULL_BLOCK:
                    break
                removed.append(ids[b])
                ids[b] = NULL_BLOCK
            self._release(removed)

    def free(self, table: Table) -> None:
        """A request is done with ``table``: tail first to the free queue, group by group."""
        for ids in table:
            self._release(reversed(ids))
            ids.clear()

    def reset(self) -> None:
        """vLLM's ``reset_prefix_cache``: forget every cached block (none may be in use)."""
        if len(self._free) != self.num_blocks - 1:
            raise ProtocolError("reset_prefix_cache with blocks in use")
        self._hash_of.clear()
        self._cached.clear()

    # -- the pool -------------------------------------------------------------------------
    def _take_cached(self, ids: Sequence[int]) -> None:
        for block in ids:
            if block == NULL_BLOCK:
                continue
            if not self._refs[block]:
                del self._free[block]
            self._refs[block] += 1

    def _take(self, n: int) -> list[int]:
        taken = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            name = self._hash_of.pop(block, None)
            if name is not None:
                del self._cached[name]
                self.evictions += 1
            self._refs[block] = 1
            taken.append(block)
        return taken

    def _release(self, ids: Iterable[int]) -> None:
        for block in ids:
            if block == NULL_BLOCK:
                continue
            self._refs[block] -= 1
            if not self._refs[block]:
                self._free[block] = None
