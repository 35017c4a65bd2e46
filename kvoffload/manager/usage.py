"""What a request used and stored, told to the index in the order recency policies need.

A request's chunks form a chain: a chunk is worth loading only if every chunk
before it is there too. So when room runs out, a recency policy must lose a
chain's *tail* before its head, never cut it in the middle. Two rules give
that order, and every caller that drives an
:class:`~kvoffload.manager.OffloadIndex` for requests goes through them:
the connector's scheduler (and through it the demo and the engine replay),
and the index-only replay of ``kvoffload replay --index-only``.

* :func:`record_use`: a request used its chunks. Every chunk of its prompt
  counts, whoever served it: the engine's own prefix cache, a load from the
  tiers, or nobody yet (chunks the index does not hold are ignored). A hot
  system prompt that the engine keeps in its own cache is therefore recent
  here too, and is not evicted as if nobody read it. Ranked tail first, so
  the head ends most recent; the engine's hits rank as recent without
  counting as hits of this tier (``OffloadIndex.refresh``), so the
  adaptive policy's admission shadows count only what this tier serves.
* :func:`record_stores`: some of its chunks were stored (or promoted from a
  lower tier). They enter the index tail first, then the chunks ahead of
  them are ranked recent again (``refresh``: an order, not another use), so
  the whole request ends ordered head-newest, tail-oldest, however many
  steps its stores took.

With these rules kvoffload's LRU reproduces the hit ratios of vLLM's LRU on
a slice of the Mooncake trace (``tests/test_replay.py``); see
:meth:`OffloadIndex.touch` for what the tail-first order is worth.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvoffload.errors import ProtocolError
from kvoffload.manager.index import OffloadIndex

__all__ = ["chain_parents", "record_stores", "record_use"]


def record_use(index: OffloadIndex, keys: Sequence[bytes], served: int = 0) -> None:
    """A request used ``keys`` (its chunks in chain order, head first): tail first.

    The first ``served`` of them came from the engine's own prefix cache: they
    rank as recent (``refresh``) but are no hit of this tier, so a policy
    that counts hits to decide what to admit is not misled by traffic the
    engine served itself. The others are ``touch`` ed.
    """
    index.touch(keys[: served - 1 : -1] if served else keys[::-1])
    if served:
        index.refresh(keys[served - 1 :: -1])


def record_stores(
    index: OffloadIndex,
    request_keys: Sequence[bytes],
    done: Sequence[bytes],
    failed: Collection[bytes] = (),
    *,
    first: int | None = None,
    parents: Sequence[bytes | None] | None = None,
    linked: bool = False,
    chained: bool = True,
) -> None:
    """Complete a request's stores: ``done`` succeeded, ``failed`` did not.

    ``request_keys`` are the request's chunks in chain order, head first;
    ``done`` is a subsequence of them, in the same order. ``failed`` slots
    are freed. ``first``: where ``done[0]`` stands in ``request_keys``, if
    the caller knows (searching a long chain for it costs a memory access
    per chunk ahead of it). Raises ``ValueError`` if ``done[0]`` is not in
    ``request_keys`` (a caller bug: the order could not be kept).

    The index learns each stored chunk's parent (:meth:`OffloadIndex.link`):
    ``parents[i]`` is ``done[i]`` 's (``None``: a head, or no full-prefix chunk),
    or, without ``parents``, the chunk before it in ``request_keys``: one chain,
    a plain layout's. ``linked``: the caller gave them to ``prepare_store`` already.
    ``chained``: ``request_keys`` is one chain; where a chunk already here lies among
    those stored (after a gap), the chain is ranked from the last one stored, so that
    every parent ends newer than its children (the order LRU keeps by).
    """
    if done:  # checked before anything changes
        if first is None:
            first = request_keys.index(done[0])
        elif not (0 <= first < len(request_keys) and request_keys[first] == done[0]):
            raise ProtocolError(f"record_stores: done[0] is not chunk {first} of the chain")
        if parents is None and not linked:
            parents = chain_parents(request_keys, done, first)
    if failed:
        index.abort_store(list(failed))
    if not done:
        return
    assert first is not None  # found above, with done
    index.complete_store(done[::-1])
    if parents is not None:
        index.link(done, parents)
    start = first
    if chained and len(done) > 1:
        last = first + len(done) - 1
        if not (last < len(request_keys) and request_keys[last] == done[-1]):  # gaps
            last = request_keys.index(done[-1], first)
            gaps = set(request_keys[first:last]).difference(done)
            if index.any_ready(gaps):
                start = last  # ranks the chunks between ahead of those stored after them
    if start:
        index.refresh(request_keys[start - 1 :: -1])  # an order, not another use


def chain_parents(chain: Sequence[bytes], done: Sequence[bytes], first: int) -> list[bytes | None]:
    """The parent of each of ``done`` (a subsequence of ``chain`` from ``chain[first]``):
    the chunk before it in ``chain``; ``None`` for the head.

    A store of consecutive chunks (the common one) costs a list copy; one with gaps
    (chunks the admission turned away) a walk over the chunks it spans.
    """
    last = first + len(done) - 1
    head = chain[first - 1] if first else None
    if last < len(chain) and chain[last] == done[-1]:
        return [head, *done[:-1]]
    parents: list[bytes | None] = []
    at = first
    for key in done:
        try:
            at = chain.index(key, at)
        except ValueError:
            raise ProtocolError("record_stores: the chunks stored are not in chain order") from None
        parents.append(chain[at - 1] if at else None)
        at += 1
    return parents
