"""What one step of a request may store: every new full-prefix chunk, and the window chunks
and states its hit points want (:mod:`kvoffload.connector._retention`).

A chunk is stored only where its blocks hold real KV (``RequestState.valid``, no null
block); a window chunk no hit point wants yet but a later one may waits in the
request's blocks (``RequestState.retry``); a state is taken in the step that reached it
or never.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

from kvoffload.config import OffloadConfig
from kvoffload.config.layout import Reuse
from kvoffload.connector._drafts import DraftedStates
from kvoffload.connector._request import RequestState, covered
from kvoffload.connector._retention import Choice, Retention
from kvoffload.connector._spans import NULL_BLOCK

__all__ = ["Chosen", "Selection", "Selector"]


class Chosen(NamedTuple):
    """A chunk a step stores: group, chunk index, its engine blocks, and why."""

    group: int
    chunk: int
    blocks: tuple[int, ...]
    choice: Choice
    #: A tail's own key (:mod:`~kvoffload.connector._tails`); ``None``: the chunk's.
    key: bytes | None = None

    def key_in(self, req: RequestState) -> bytes:
        """The key the chunk is stored under."""
        return req.keys[self.group][self.chunk] if self.key is None else self.key


class Selection(NamedTuple):
    """What one step of one request may store, and how many chunks it passed over."""

    chosen: list[Chosen]
    #: Chunks whose KV is not there (a null block, blocks no one wrote).
    invalid: int
    #: Window chunks and states no hit point of the request wants.
    unretained: int
    #: States accepted drafts may have moved (:mod:`~kvoffload.connector._drafts`).
    drafted: int = 0

    def __bool__(self) -> bool:
        return bool(self.chosen)


def state_point(state: Chosen, spans: Sequence[int]) -> int:
    """The boundary (in tokens) a state chunk's state is taken at: its chunk's end."""
    return (state.chunk + 1) * spans[state.group]


class Selector:
    """Chooses what each step of a request stores, as its :class:`Retention` wants."""

    def __init__(self, config: OffloadConfig, retention: Retention) -> None:
        self.layout = config.layout
        self.spans = config.tokens_per_chunk
        self.bpc = config.blocks_per_chunk
        self.retention = retention

    def select(
        self,
        req: RequestState,
        block_ids: Sequence[Sequence[int]],
        bounds: tuple[int, int],
        states: Collection[tuple[int, int, int]] = (),
    ) -> Selection:
        """The chunks a step computing tokens ``bounds = (computed, end)`` may store.

        Every new or retried chunk below ``end`` whose KV is valid, if its
        group needs every chunk or a hit point of the request wants it; the
        others are counted and never looked at again, except window chunks
        a later hit point may want (``retry``). ``states`` as in
        :attr:`~kvoffload.connector._request.StepRequest.states`.
        """
        end = bounds[1]
        chosen: list[Chosen] = []
        invalid = unretained = drafted = 0
        for g, (group, span) in enumerate(zip(self.layout.groups, self.spans, strict=True)):
            if group.reuse is Reuse.STATE:
                continue
            blocks, stop = block_ids[g], end // span
            new = range(req.next_chunk[g], stop)
            if (
                group.reuse is Reuse.PREFIX
                and not req.retry[g]
                and self._all_valid(blocks, req.valid[g], new, span)
            ):  # the common case, checked at once: every new chunk is stored
                bpc = self.bpc
                chosen += [
                    Chosen(g, c, tuple(blocks[c * bpc : (c + 1) * bpc]), Choice.KEEP) for c in new
                ]
            else:
                bad, unwanted = self._select_group(req, g, blocks, new, end=end, chosen=chosen)
                invalid, unretained = invalid + bad, unretained + unwanted
            req.next_chunk[g] = max(req.next_chunk[g], stop)
        for state in self._states(req, block_ids, bounds, states):
            if state.choice is Choice.SKIP:
                unretained += 1
            elif state.blocks[0] == NULL_BLOCK:
                invalid += 1
            elif req.drafted and DraftedStates.moved(req, state_point(state, self.spans)):
                drafted += 1
            else:
                chosen.append(state)
        return Selection(chosen, invalid, unretained, drafted)

    def _select_group(
        self,
        req: RequestState,
        g: int,
        blocks: Sequence[int],
        new: range,
        *,
        end: int,
        chosen: list[Chosen],
    ) -> tuple[int, int]:
        """:meth:`select` for group ``g`` chunk by chunk: its retries, then ``new``.

        Appends what is stored to ``chosen``; returns how many chunks had no valid
        KV and how many no hit point wants.
        """
        group, span, bpc, valid = self.layout.groups[g], self.spans[g], self.bpc, req.valid[g]
        invalid = unretained = 0
        todo: Iterable[int] = new
        if req.retry[g]:
            todo, req.retry[g] = [*sorted(req.retry[g]), *todo], set()
        inside = (0, 0)  # the valid range the last chunk lay in: most chunks share one
        for c in todo:
            ids = tuple(blocks[c * bpc : (c + 1) * bpc])
            lo, hi = c * span, (c + 1) * span
            if not (inside[0] <= lo and hi <= inside[1]):
                inside = next((r for r in valid if r[0] <= lo and hi <= r[1]), (0, 0))
            if len(ids) < bpc or NULL_BLOCK in ids or inside == (0, 0):
                invalid += 1
                continue
            choice = (
                Choice.KEEP
                if group.reuse is Reuse.PREFIX
                else self.retention.window_choice(req, g, c, end)
            )
            if choice is Choice.WAIT:
                req.retry[g].add(c)
            elif choice is Choice.SKIP:
                unretained += 1
            else:
                chosen.append(Chosen(g, c, ids, choice))
        return invalid, unretained

    def retry_later(self, req: RequestState, chosen: Iterable[Chosen]) -> None:
        """Chunks a step selected that found no CPU slot (stores in flight): the next step.

        A state is not retried: the engine overwrites it once the request moves on;
        nor is a tail, which needs its states.
        """
        for c in chosen:
            if self.layout.groups[c.group].reuse is not Reuse.STATE and c.key is None:
                req.retry[c.group].add(c.chunk)

    def retry_run(self, req: RequestState, chunks: Iterable[int]) -> None:
        """:meth:`retry_later` for a plain layout's chunk indices."""
        req.retry[0].update(chunks)

    def plain_run(self, req: RequestState, blocks: Sequence[int], end: int) -> range | None:
        """A plain layout's common step at once: the chunks a step computing up to ``end``
        completes, if each has its ``blocks`` and valid KV and none waits for a retry.

        :meth:`select` would keep every one of them; since admission turns most
        of them away, they are not made one :class:`Chosen` each. ``None``
        (any other layout, or a chunk to look at): ask :meth:`select`.
        """
        if not self.retention.plain or req.retry[0]:
            return None
        span, first = self.spans[0], req.next_chunk[0]
        run = range(first, max(first, end // span))
        if not self._all_valid(blocks, req.valid[0], run, span):
            return None
        req.next_chunk[0] = run.stop
        return run

    def _all_valid(
        self, blocks: Sequence[int], valid: list[tuple[int, int]], chunks: range, span: int
    ) -> bool:
        """Whether every chunk in ``chunks`` has all its blocks and valid KV."""
        if not chunks:
            return True
        run = blocks[chunks.start * self.bpc : chunks.stop * self.bpc]
        return (
            len(run) == len(chunks) * self.bpc
            and NULL_BLOCK not in run
            and covered(valid, chunks.start * span, chunks.stop * span)
        )

    def _states(
        self,
        req: RequestState,
        block_ids: Sequence[Sequence[int]],
        bounds: tuple[int, int],
        handed: Collection[tuple[int, int, int]],
    ) -> list[Chosen]:
        """The states at chunk boundaries a step finds in the engine's blocks.

        The state after ``computed`` tokens (the previous step's end, or a hit)
        is still in its block, and the one after ``end`` is there once the
        forward pass ran; ``handed`` adds states vLLM reports written inside
        the step (a prefill checkpoint).
        """
        out = []
        for g, (group, span) in enumerate(zip(self.layout.groups, self.spans, strict=True)):
            if group.reuse is not Reuse.STATE:
                continue
            tpb, blocks = group.tokens_per_block, block_ids[g]
            found = {b: blocks[b // tpb - 1] for b in bounds if 0 < b <= len(blocks) * tpb}
            found.update({b: block for h, block, b in handed if h == g and b > 0})
            for point, block in sorted(found.items()):
                if point % span or not covered(req.valid[g], point - 1, point):
                    continue
                choice = self.retention.state_choice(req, point)
                out.append(Chosen(g, point // span - 1, (block,), choice))
        return out
