"""What the stand-in does with a connector's loads once its worker reports them, as vLLM 0.32.

A load that finished resumes its request at the next step, its blocks cached; a
failed one is recomputed from what is left valid: from its first failed block
(block ids are reported for layouts of one group), or from the start where the
whole request failed (hybrid layouts). A load the step itself ran
(``load_in_step``) is cut at its first failed block the same way. With KV pages,
every block a load filled is checked bit-exact. Apart from
:mod:`kvoffload.standin._engine`, the loop that schedules, which calls these at
the points where vLLM's scheduler handles loads.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvoffload.config.layout import KVLayout
from kvoffload.standin._forward import verify_blocks
from kvoffload.standin._kv import KVPages
from kvoffload.standin._prefix_cache import PrefixCache
from kvoffload.standin._types import SimRequest, StandInStats, Status, WorkerResult

__all__ = ["LoadOutcomes"]


@dataclass(slots=True)
class LoadOutcomes:
    """The loads of one stand-in engine, counted in its ``stats`` (the same object);
    ``kv``: its KV pages, if any, which every loaded block is checked against."""

    layout: KVLayout
    cache: PrefixCache
    stats: StandInStats
    kv: KVPages | None
    #: Requests whose loads the worker reported, until they resume: ``True`` if it succeeded.
    received: dict[str, bool] = field(default_factory=dict)

    def record(self, waiting: Iterable[SimRequest], result: WorkerResult) -> None:
        """Loads that finished this step; the request resumes when next scheduled."""
        for req in waiting:
            if req.status is Status.LOADING and req.req_id in result.finished_recving:
                if req.req_id in result.failed_recving:
                    self.received[req.req_id] = False
                    continue
                self._cut_at_failed_block(req, result.failed_blocks)
                self.received[req.req_id] = True

    def _cut_at_failed_block(self, req: SimRequest, failed_blocks: Collection[int]) -> bool:
        """vLLM's ``_update_requests_with_invalid_blocks``: with block ids (one group), the
        request's computed tokens go back to its first failed block; ``True`` if one was."""
        if len(self.layout.groups) != 1:
            return False
        tpb = self.layout.groups[0].tokens_per_block
        for i, block in enumerate(req.blocks[0][: -(-req.computed // tpb)]):
            if block in failed_blocks:
                self.stats.failed_load_tokens += req.computed - i * tpb
                req.computed = req.final = i * tpb
                return True
        return False

    def loaded_in_step(self, req: SimRequest, result: WorkerResult) -> bool:
        """vLLM's ``_handle_invalid_blocks`` for a load the step ran: ``False`` if it failed
        (only layouts of one group load in the step, see
        :func:`kvoffload.connector.loads.loads_in_step`)."""
        loaded = req.computed - req.local_hit
        if self._cut_at_failed_block(req, result.failed_blocks):
            return False
        self.stats.loaded_tokens += loaded
        if loaded and self.kv is not None:
            self._verify(req, req.local_hit, req.computed)
        return True

    def resume(self, req: SimRequest, ok: bool) -> None:
        """vLLM's ``_update_waiting_for_remote_kv``: cache what is valid, or start over."""
        if not ok:  # a failed request (hybrid layouts): vLLM starts it over, lookups included
            self.stats.failed_load_tokens += req.computed - req.local_hit
            req.computed = req.final = 0
        loaded = max(0, req.computed - req.local_hit)
        self.stats.loaded_tokens += loaded
        if loaded and self.kv is not None:
            self._verify(req, req.local_hit, req.computed)
        if req.computed:
            self.cache.cache(req.blocks, req.hashes, req.computed)
        else:
            self.cache.free(req.blocks)
            req.told = [0] * len(req.blocks)
        req.status = Status.WAITING

    def _verify(self, req: SimRequest, start: int, stop: int) -> None:
        """Check every full block a load of tokens ``[start, stop)`` filled, bit-exact."""
        assert self.kv is not None
        exact, wrong = verify_blocks(self.kv, self.layout, req, start, stop)
        self.stats.verified_blocks += exact
        self.stats.mismatched_blocks += wrong
