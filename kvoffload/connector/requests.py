"""The request table: each request's state from its first lookup until its last job is reported.

Keys are made here, once per chunk, as a request's tokens become known: from its token
ids, or, given ``engine_hashes``, by chaining the engine's own block hashes of the request
(:func:`~kvoffload.keys.extend_engine_keys`; the ``key_source`` key chooses,
:mod:`kvoffload.connector.key_source`). A request is forgotten when it has finished and
no job of it is in flight, so a report that arrives after ``request_finished`` still
finds what to complete.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from kvoffload.connector._request import RequestState
from kvoffload.errors import ProtocolError
from kvoffload.keys import EngineHashes, KeyExtras

__all__ = ["Lookup", "RequestTable"]


class Lookup(NamedTuple):
    """One lookup of a request, keyed: what the hit finder searches."""

    req: RequestState
    token_ids: Sequence[int]
    block_hashes: Sequence[bytes] | None
    #: The engine's own hit, in tokens.
    local_hit: int
    #: Tokens a hit may cover: all but the prompt's unhittable end, as far as they can be
    #: keyed. A tail may end on any block boundary up to there
    #: (:mod:`~kvoffload.connector._tails`).
    keyable: int
    #: ``keyable`` rounded down to the hit alignment: where hits at chunk ends stop, and
    #: how far the request is keyed.
    top: int


class RequestTable:
    """Requests by id, and the key rules they share (``tokens_per_chunk``, namespace, source)."""

    def __init__(
        self,
        tokens_per_chunk: Sequence[int],
        namespace: bytes,
        *,
        plain: bool,
        alignment: int = 1,
        engine_hashes: EngineHashes | None = None,
        lookahead: int = 0,
    ) -> None:
        self.tokens_per_chunk = tuple(tokens_per_chunk)
        #: Hits land on multiples of this many tokens (every group's chunk boundary).
        self.alignment = alignment
        self.namespace = namespace
        self.engine_hashes = engine_hashes
        #: Tokens after a chunk its KV depends on (``KVLayout.lookahead``).
        self.lookahead = lookahead
        #: Tokens at the end of a prompt no hit can cover: the one vLLM computes for the
        #: logits, or the lookahead a key needs after its chunk.
        self.unhittable = max(1, lookahead)
        #: One full-attention group: a request is keyed once its keys cover the tokens.
        self._plain = plain
        self._requests: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._requests.values())

    def get(self, req_id: str) -> RequestState | None:
        return self._requests.get(req_id)

    def open(self, req_id: str, extras: KeyExtras | None = None) -> RequestState:
        """The request's state; created with ``extras`` at first sight (they never change)."""
        req = self._requests.get(req_id)
        if req is None:
            req = RequestState.empty(len(self.tokens_per_chunk), extras)
            self._requests[req_id] = req
        return req

    def lookup(
        self,
        req_id: str,
        token_ids: Sequence[int],
        local_hit: int,
        extras: KeyExtras | None,
        block_hashes: Sequence[bytes] | None,
    ) -> Lookup:
        """The request asked about, its last lookup's offer forgotten, keyed up to its top.

        Keyed even when the engine's own cache serves everything: ``plan_load`` records
        the use of every chunk of the prompt.
        """
        req = self.open(req_id, extras)
        keyable = self.keyable(len(token_ids) - self.unhittable, block_hashes)
        top = keyable // self.alignment * self.alignment
        req.local_hit, req.offered, req.use_recorded, req.in_step = local_hit, 0, False, False
        req.tail_keys = ()
        self.extend_keys(req, token_ids, block_hashes, top)
        return Lookup(req, token_ids, block_hashes, local_hit, keyable, top)

    def arrived(
        self,
        req_id: str,
        token_ids: Sequence[int],
        extras: KeyExtras | None,
        block_hashes: Sequence[bytes] | None,
    ) -> RequestState:
        """A request the engine queued, keyed as its first lookup will key it (which then
        finds the keys made)."""
        req = self.open(req_id, extras)
        keyable = self.keyable(len(token_ids) - self.unhittable, block_hashes)
        self.extend_keys(req, token_ids, block_hashes, keyable // self.alignment * self.alignment)
        return req

    def release(self, req_id: str, job_id: int | None) -> None:
        """Job ``job_id`` of the request is done (``None``: it finished); forget it once both."""
        req = self._requests.get(req_id)
        if req is None:
            return
        if job_id is not None:
            req.jobs.discard(job_id)
        if req.finished and not req.jobs:
            del self._requests[req_id]

    def keyable(self, tokens: int, block_hashes: Sequence[bytes] | None) -> int:
        """How many of the first ``tokens`` tokens can be keyed: with engine keys, those the
        engine has hashed."""
        engine = self.engine_hashes
        if engine is None or block_hashes is None:
            return tokens
        return min(tokens, len(block_hashes) * engine.block_size)

    def storable(self, end: int, known: int) -> int:
        """Of ``end`` tokens computed after a step, how many a store may cover (``known``:
        the tokens the request has). With a lookahead, a key needs the tokens after its
        chunk, and the KV of the last ``lookahead - 1`` computed tokens is not final: a
        multi-token drafter computes it again from the next step's tokens (vLLM caches
        none of them either)."""
        k = self.lookahead
        return end if not k else max(0, min(end - k + 1, known - k))

    def extend_keys(
        self,
        req: RequestState,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes] | None,
        tokens: int,
    ) -> None:
        """Key every full chunk of ``req`` in its first ``tokens`` tokens."""
        engine = self.engine_hashes
        if engine is not None and block_hashes is None:
            raise ProtocolError(
                "this scheduler makes keys from the engine's block hashes: pass each "
                "request's block_hashes to lookup and plan_step"
            )
        if self._plain and len(req.keys[0]) >= tokens // self.tokens_per_chunk[0]:
            return  # keyed already: most steps after a request's lookup
        req.extend_keys(
            token_ids,
            tokens,
            self.tokens_per_chunk,
            self.namespace,
            engine=engine,
            block_hashes=block_hashes or (),
            lookahead=self.lookahead,
        )

    def keys_for(
        self,
        token_ids: Sequence[int],
        extras: KeyExtras | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> list[list[bytes]]:
        """Per group, the keys of a request's full chunks, without tracking it."""
        req = RequestState.empty(len(self.tokens_per_chunk), extras)
        self.extend_keys(req, token_ids, block_hashes, self.keyable(len(token_ids), block_hashes))
        return req.keys
