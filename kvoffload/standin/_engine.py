"""The stand-in's engine loop: vLLM 0.32's schedule, execute and update steps around a connector."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence

from kvoffload.config.layout import KVLayout
from kvoffload.errors import ConfigError, IntegrityError
from kvoffload.keys import KeyExtras, prefix_keys, prefix_keys_for_layout
from kvoffload.standin._forward import carry_states, check_lookahead, final_after, write_step
from kvoffload.standin._kv import KVPages
from kvoffload.standin._loads import LoadOutcomes
from kvoffload.standin._prefix_cache import PrefixCache
from kvoffload.standin._state import aligned_stop, state_block_size
from kvoffload.standin._types import ConnectorSide, SimRequest, StandInStats, Status, StepPlan

__all__ = ["MAX_IDLE_STEPS", "StandIn"]

#: Steps in a row that schedule nothing before the stand-in gives up (a stuck connector).
MAX_IDLE_STEPS = 1000
_GPU_NAMESPACE = b"kvoffload stand-in: GPU prefix cache"


class StandIn:
    """vLLM's engine loop around one connector (see the module docstring).

    ``kv``: the engine's KV tensors as pages; with them every computed block
    gets its KV written and every loaded block is checked bit-exact.
    ``decode_tokens``: a decode step runs to the next multiple of it (vLLM: 1,
    one token a step). A coarser step plans the same stores when it divides
    every group's chunk span (``tokens_per_block * blocks_per_chunk``): a
    chunk end then falls only on a step's end, so each step stores what the
    one-token step ending there would and those between store nothing; every
    hit point (a multiple of the spans) is still a step end, where a state is
    taken; it only saves steps. ``prefix_caching``: vLLM's
    ``enable_prefix_caching``; without it no request reuses another's blocks.
    """

    def __init__(
        self,
        layout: KVLayout,
        side: ConnectorSide,
        *,
        gpu_blocks: int,
        step_tokens: int = 8192,
        max_running: int = 16,
        kv: KVPages | None = None,
        decode_tokens: int = 1,
        prefix_caching: bool = True,
    ) -> None:
        block = state_block_size(layout)
        if block is not None and step_tokens < block:
            raise ConfigError(
                f"step_tokens={step_tokens} is below the state groups' block of {block} tokens: "
                "vLLM's align mode ends every prefill step on a block; give more step tokens"
            )
        if decode_tokens < 1:
            raise ConfigError(f"decode_tokens={decode_tokens}: a decode step computes 1 or more")
        check_lookahead(layout)
        self.layout, self.side, self.kv = layout, side, kv
        self.cache = PrefixCache(layout, gpu_blocks, caching=prefix_caching)
        #: Tokens per ``SimRequest.block_hashes`` entry (vLLM's ``hash_block_size``).
        self.hash_block_size = math.gcd(*layout.tokens_per_block)
        self.step_tokens, self.max_running = step_tokens, max_running
        self.decode_tokens = decode_tokens
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.stats = StandInStats()
        #: What becomes of the connector's loads (counted in :attr:`stats`).
        self.loads = LoadOutcomes(layout, self.cache, self.stats, kv)
        self._finished: set[str] = set()
        self._idle = 0

    # -- feeding requests -----------------------------------------------------------------
    def add(
        self,
        req_id: str,
        tokens: Sequence[int],
        extras: KeyExtras | None = None,
        *,
        output: Sequence[int] = (),
        kv_transfer_params: Mapping[str, object] | None = None,
    ) -> SimRequest:
        """A new request of prompt ``tokens`` that generates ``output`` (decoded after the
        prompt), with the client's ``kv_transfer_params`` if any; ``ConfigError`` if it
        could never fit in the GPU cache."""
        num_prompt = len(tokens)
        if output:
            tokens = [*tokens, *output]
        need = sum(-(-len(tokens) // tpb) for tpb in self.layout.tokens_per_block)
        if need >= self.cache.num_blocks:
            raise ConfigError(
                f"request {req_id!r} ({len(tokens)} tokens) needs up to {need} blocks, more than "
                f"a GPU cache of {self.cache.num_blocks} holds; give more GPU blocks"
            )
        groups = len(self.layout.groups)
        # Only the GPU prefix cache and the KV pages read them: without both, none are made.
        needed = self.cache.caching or self.kv is not None
        hashes = self.block_hashes(tokens, extras) if needed else [[] for _ in range(groups)]
        flat = self.request_hashes(tokens, extras, known=hashes)
        req = SimRequest(
            req_id,
            tokens,
            hashes,
            [[] for _ in range(groups)],
            extras,
            told=[0] * groups,
            num_prompt=num_prompt,
            block_hashes=flat,
            kv_transfer_params=kv_transfer_params,
        )
        if self.layout.lookahead and self.kv is not None:  # what a block holds until final
            req.provisional = self.block_hashes(tokens, extras, lookahead=0)
        self.side.add_request(req)
        self.waiting.append(req)
        return req

    def block_hashes(
        self, tokens: Sequence[int], extras: KeyExtras | None = None, lookahead: int | None = None
    ) -> list[list[bytes]]:
        """Per group, the GPU prefix cache's hash of each full block (vLLM's, salts included):
        with the layout's lookahead (or ``lookahead``), of the tokens after it too, as vLLM
        0.34's lookahead block hashes, so only blocks with those tokens have one."""
        tpb = self.layout.tokens_per_block
        k = self.layout.lookahead if lookahead is None else lookahead
        return prefix_keys_for_layout(tokens, tpb, _GPU_NAMESPACE, extras=extras, lookahead=k)

    def request_hashes(
        self,
        tokens: Sequence[int],
        extras: KeyExtras | None = None,
        *,
        known: Sequence[Sequence[bytes]] = (),
    ) -> list[bytes]:
        """vLLM's ``request.block_hashes``: one per :attr:`hash_block_size` tokens, as a
        connector reads them. They are the :meth:`block_hashes` of the first group of that
        block size, if any (taken from ``known`` when given there), with the lookahead."""
        size, sizes, k = self.hash_block_size, self.layout.tokens_per_block, self.layout.lookahead
        g = sizes.index(size) if size in sizes else 0
        if g < len(known) and sizes[g] == size and len(known[g]) == max(0, len(tokens) - k) // size:
            return list(known[g])
        return prefix_keys(tokens, size, g, _GPU_NAMESPACE, extras=extras, lookahead=k)

    def run(
        self,
        requests: Iterable[tuple[str, Sequence[int]] | tuple[str, Sequence[int], Sequence[int]]],
        in_flight: int = 4,
    ) -> StandInStats:
        """Serve ``requests`` (id, prompt, and the output it generates if any) in order, at
        most ``in_flight`` in the engine at once."""
        start = time.perf_counter()
        source = iter(requests)
        more = True
        while True:
            while more and len(self.waiting) + len(self.running) < in_flight:
                item = next(source, None)
                more = item is not None
                if item is not None:
                    self.add(item[0], item[1], output=item[2] if len(item) > 2 else ())
            if not (self.waiting or self.running):
                break
            self.step()
        self.step()  # vLLM tells the connector of the last finished requests one step later
        self.stats.seconds += time.perf_counter() - start
        return self.stats

    def reset_prefix_cache(self) -> None:
        """vLLM's ``LLM.reset_prefix_cache()``: empty the GPU cache, not the connector's tiers."""
        self.cache.reset()

    # -- one step -------------------------------------------------------------------------
    def step(self) -> StepPlan:
        plan = StepPlan(finished=self._finished)
        self._finished = set()
        self.cache.new_step()
        budget = self._schedule_running(plan, self.step_tokens)
        self._schedule_waiting(plan, budget)
        for req, _ in plan.scheduled:
            plan.new_blocks[req.req_id] = [
                ids[n:] for ids, n in zip(req.blocks, req.told, strict=True)
            ]
            req.told = [len(ids) for ids in req.blocks]
        meta = self.side.build_connector_meta(plan)
        if self.kv is not None:
            for req, n in plan.scheduled:
                carry_states(self.kv, self.layout, req, n)
        result = self.side.run_worker(meta, lambda: self._forward(plan))
        for req, n in plan.scheduled:
            if req.req_id in plan.in_step and not self.loads.loaded_in_step(req, result):
                continue  # vLLM drops the step's output and recomputes from the failed block
            req.computed += n
            req.final = final_after(self.layout, req, req.computed)
            if req.computed >= req.last:
                self._finish(req)
        self.side.update_connector_output(result)
        self.loads.record(self.waiting, result)
        stats = self.stats
        stats.steps += 1
        stats.scheduler_seconds = self.side.clock.seconds
        stats.gpu_evictions = self.cache.evictions
        self._idle = 0 if plan.scheduled else self._idle + 1
        if self._idle > MAX_IDLE_STEPS:
            raise IntegrityError(f"the stand-in scheduled nothing for {MAX_IDLE_STEPS} steps")
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Running requests continue their prefill first, as in vLLM.

        There is no preemption: admission reserved every admitted prompt's
        blocks (:meth:`_fits`), so a running request always finds its own.
        """
        for req in self.running:
            if budget <= 0:
                break
            n = self._tokens(req, budget)
            if not n:
                continue
            self.cache.remove_skipped(req.blocks, req.computed)
            if not self.cache.allocate(req.blocks, None, req.computed, req.computed + n):
                msg = f"request {req.req_id!r} found no blocks: the reserve is wrong"
                raise IntegrityError(msg)
            final = final_after(self.layout, req, req.computed + n)
            self.cache.cache(req.blocks, req.hashes, final)
            plan.scheduled.append((req, n))
            budget -= n
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[i]
            if req.status is Status.LOADING:
                if req.req_id not in self.loads.received:
                    i += 1
                    continue
                self.loads.resume(req, self.loads.received.pop(req.req_id))
            hit, local, external = None, 0, 0
            if req.computed == 0 and not self._fits(req):
                break
            in_step = False
            if req.computed == 0:
                # A hit leaves a token to compute, and the lookahead after it in the prompt.
                unhit = max(0, self.layout.lookahead - 1)
                local, hit = self.cache.longest_hit(req.hashes, req.num_prompt - unhit)
                offered = self.side.get_num_new_matched_tokens(req, local)
                if offered is None:
                    self.stats.deferred_lookups += 1
                    i += 1
                    continue
                external, req.computed = offered, local + offered
                in_step = bool(external) and self.side.loads_in_step(req)
            n = 0 if external and not in_step else self._tokens(req, budget)
            if not (n or external):
                req.computed -= local
                break
            if not self.cache.allocate(req.blocks, hit, req.computed, req.computed + n):
                req.computed -= local + external
                break
            self.side.update_state_after_alloc(req, external)
            if hit is not None:  # what it hit and loads is final KV
                req.local_hit, req.external, req.final = local, external, req.computed
                self.stats.gpu_hit_tokens += local
                self.stats.external_tokens += external
            if external and not in_step:
                req.status = Status.LOADING
                i += 1
                continue
            if in_step:  # vLLM caches a same-step load's blocks at once, as computed
                plan.in_step.add(req.req_id)
            final = final_after(self.layout, req, req.computed + n)
            self.cache.cache(req.blocks, req.hashes, final)
            self.waiting.pop(i)
            self.running.append(req)
            req.status = Status.RUNNING
            plan.scheduled.append((req, n))
            plan.first.add(req.req_id)
            budget -= n

    def _tokens(self, req: SimRequest, budget: int) -> int:
        """Tokens of ``req`` this step computes, within ``budget``: its prefill in vLLM's align
        split, then decode steps to the next multiple of ``decode_tokens``."""
        done = req.computed
        if done >= req.num_prompt:
            step = self.decode_tokens
            return min(req.last, (done // step + 1) * step, done + budget) - done
        stop = min(req.num_prompt, done + budget)
        return aligned_stop(self.layout, done, stop, req.num_prompt) - done

    def _fits(self, req: SimRequest) -> bool:
        """vLLM's admission reserve: a new request's whole prompt and what the admitted ones
        still need must fit in the free blocks, so no admitted request ever waits for blocks
        that only a request waiting behind it could free."""
        tpb = self.layout.tokens_per_block
        need = sum(-(-req.num_tokens // t) for t in tpb)
        for other in [*self.running, *self.waiting]:
            if other.blocks[0] or other.status is not Status.WAITING:
                need += sum(
                    max(0, -(-other.num_tokens // t) - len(ids))
                    for t, ids in zip(tpb, other.blocks, strict=True)
                )
        return need <= self.cache.num_free

    # -- after the forward pass -----------------------------------------------------------
    def _finish(self, req: SimRequest) -> None:
        self.cache.remove_skipped(req.blocks, req.computed)
        self.side.request_finished(req)
        self.cache.free(req.blocks)
        self.running.remove(req)
        req.status = Status.FINISHED
        self._finished.add(req.req_id)
        self.stats.requests += 1
        self.stats.prompt_tokens += req.num_prompt

    # -- the forward pass -----------------------------------------------------------------
    def _forward(self, plan: StepPlan) -> None:
        """Write the KV of every full block the step computes or makes final (with ``kv``);
        a wrong state a step ran from counts as a mismatched block."""
        if self.kv is not None:
            for req, n in plan.scheduled:
                self.stats.mismatched_blocks += write_step(self.kv, self.layout, req, n)
