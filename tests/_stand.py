"""A harness for the connector core end to end: OffloadScheduler and OffloadWorker, no engine.

Shared by the tests of load and store plans (``test_vllm_plan``) and of retention
(``test_vllm_retention``); the ``stand`` fixture builds stands and closes them.

:class:`Stand` plays vLLM's part around the real pieces (an
``OffloadScheduler`` with its real index, ``OffloadWorker`` ranks over real
``OffloadEngine``\\ s, real KV tensors, real disk files), one call at a time,
for the cases the package's stand-in (:mod:`kvoffload.standin`, which
serves whole steps) does not reach: tensor-parallel ranks, a rank that
refuses orders, reports held back or delivered late, block tables edited by
hand. KV content is the stand-in's (:class:`~kvoffload.standin.KVPages`:
a function of each block's hash), so a loaded block is checked bit-exact with
no copy of what was stored; block ids are shuffled per group, so copies go
through scattered blocks too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout, Reuse
from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.connector.worker import OffloadWorker
from kvoffload.engine import JobKind, OffloadEngine
from kvoffload.keys import namespace_of, prefix_keys_for_layout
from kvoffload.manager.index import OffloadIndex
from kvoffload.messages import JobReport, TransferOrder
from kvoffload.standin import NULL_BLOCK, KVPages, aligned_stop, state_key
from kvoffload.tiers.disk import DiskProbe
from kvoffload.transfer import allocate_kv_caches

PAGE = 256  # bytes of one block of one layer, the same in every group (as in vLLM)
WINDOW = 24
SCRUB = 0xA5  # what a freshly allocated block holds: no KV at all


@dataclass(frozen=True)
class Model:
    name: str
    layout: KVLayout
    bpc: int  # blocks per chunk


#: One full-attention group, like Llama: 8-token chunks.
LLAMA = Model("llama", KVLayout((CacheGroup("full", 4, ("l0", "l1"), PAGE),)), bpc=2)
#: Like Gemma-4, scaled down: three sliding-window groups and one full group.
GEMMA = Model(
    "gemma",
    KVLayout(
        (
            *(CacheGroup("sliding", 16, (f"s{i}",), PAGE, sliding_window=WINDOW) for i in range(3)),
            CacheGroup("full", 4, ("f0",), PAGE),
        )
    ),
    bpc=2,
)
#: Like Qwen3-Next, scaled down: three recurrent-state groups (one state of STATE bytes per
#: block, padded to PAGE in the engine's tensors) and one full group, one block size.
STATE = 160
QWEN = Model(
    "qwen",
    KVLayout(
        (
            *(CacheGroup("mamba", 8, (f"m{i}",), STATE) for i in range(3)),
            CacheGroup("full", 8, ("a0",), PAGE),
        )
    ),
    bpc=1,
)
MODELS = pytest.mark.parametrize("model", [LLAMA, GEMMA, QWEN], ids=lambda m: m.name)


def make_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(n)]


def page(kv: dict[str, torch.Tensor], layer: str, block: int) -> torch.Tensor:
    """The bytes of ``block`` of ``layer`` (a view into the engine tensor)."""
    return kv[layer][block].reshape(-1).view(torch.uint8)


def block_hashes(layout: KVLayout, tokens: Sequence[int]) -> list[list[bytes]]:
    """Per group, the hash of each full block: what its KV is a function of."""
    return prefix_keys_for_layout(tokens, layout.tokens_per_block, b"test blocks")


def first_token(group: CacheGroup, local: int, hit: int) -> int:
    """The first token of ``group`` a hit at ``hit`` must supply beyond the engine's ``local``.

    A recurrent group supplies the block ending at ``hit``: the state after ``hit`` tokens.
    """
    if group.reuse is Reuse.STATE:
        return max(local, hit - 1)
    if group.sliding_window is None:
        return local
    return max(local, hit - group.sliding_window + 1)


def reference_hit(
    model: Model, n_tokens: int, local: int, stored: Callable[[int, int], bool]
) -> int:
    """The longest aligned hit for ``n_tokens`` whose needed chunks are all ``stored(g, c)``."""
    spans = [g.tokens_per_block * model.bpc for g in model.layout.groups]
    align = math.lcm(*spans)
    hit = (n_tokens - 1) // align * align
    while hit > local:
        if all(
            stored(g, c)
            for g, group in enumerate(model.layout.groups)
            for c in range(first_token(group, local, hit) // spans[g], hit // spans[g])
        ):
            return hit
        hit -= align
    return local


@dataclass
class Req:
    """One request as vLLM's scheduler sees it."""

    req_id: str
    tokens: list[int]
    local_hit: int
    offered: int | None  # lookup's answer; None means "ask again later"
    hashes: list[list[bytes]] = field(default_factory=list)  # per group, full blocks
    blocks: list[list[int]] = field(default_factory=list)  # per group, NULL_BLOCK included
    computed: int = 0  # vLLM's num_computed_tokens
    load: TransferOrder | None = None
    verified: int = 0  # loaded blocks found bit-exact (rank 0)
    #: Prompt tokens when ``tokens`` holds generated ones after them (None: all prompt).
    prompt_len: int | None = None
    #: Per group, the blocks a load of the hit must fill (kept after the request finished).
    load_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def hit(self) -> int:
        assert self.offered is not None
        return self.local_hit + self.offered


@dataclass
class Step:
    """What one engine step's polls returned, every rank together."""

    orders: list[TransferOrder]
    finished: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
    reports: list[list[JobReport]] = field(default_factory=list)  # per rank

    def merge(self, other: Step) -> Step:
        return Step(
            self.orders + other.orders,
            self.finished | other.finished,
            self.failed_recving | other.failed_recving,
            self.failed_blocks | other.failed_blocks,
            self.reports + other.reports,
        )


class Stand:
    """vLLM's part around one ``OffloadScheduler`` and ``world_size`` worker ranks.

    ``null_window``: like vLLM's sliding-window manager, a request admitted
    with a hit gets the null block for every sliding block wholly before the
    window of its hit point; otherwise it gets real (unfilled) blocks there.
    """

    def __init__(
        self,
        model: Model,
        root: Path,
        *,
        cpu_chunks: int = 96,
        disk: bool = False,
        probe: bool = False,
        world_size: int = 1,
        null_window: bool = True,
        policy: str | None = None,
        num_blocks: int = 160,
        retention_interval: int = 1,
    ) -> None:
        self.model, self.layout, self.null_window = model, model.layout, null_window
        slot = max(g.chunk_bytes(model.bpc) for g in self.layout.groups)
        # Every chunk stored by default (retention_interval 1): these tests are about hits,
        # loads and failures; which chunks retention keeps is tested in test_vllm_retention.py.
        extra: dict[str, object] = {
            "cpu_bytes_to_use": cpu_chunks * slot * world_size,
            "blocks_per_chunk": model.bpc,
            "retention_interval": retention_interval,
        }
        if policy is not None:
            extra["eviction_policy"] = policy
        if disk:
            extra.update(disk_path=str(root / "disk"), disk_bytes_to_use=8 << 20)
        self.config = build_offloading_config(extra, self.layout, world_size)
        self.namespace = namespace_of("kvoffload-test", "bfloat16", self.layout)
        probes = [DiskProbe(root / "disk", self.namespace)] if probe else []
        self.scheduler = OffloadScheduler(
            self.config, self.namespace, probes, world_size=world_size
        )
        self.kv = [allocate_kv_caches(self.layout, num_blocks) for _ in range(world_size)]
        self.pages = [KVPages(self.layout, kv) for kv in self.kv]
        single = len(self.layout.groups) == 1
        self.workers = [
            OffloadWorker(OffloadEngine.from_config(self.config, kv, self.namespace),
                          report_blocks=single)
            for kv in self.kv
        ]  # fmt: skip
        self._free = []
        for g in range(len(self.layout.groups)):
            ids = list(range(1, num_blocks))  # never NULL_BLOCK
            random.Random(g).shuffle(ids)
            self._free.append(ids)
        self._closed = False
        self._down: set[int] = set()

    @property
    def index(self) -> OffloadIndex:
        return self.scheduler.index

    def close_rank(self, rank: int) -> None:
        """Shut one rank's engine down: it refuses every order from now on."""
        self.workers[rank].engine.close()
        self._down.add(rank)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for worker in self.workers:
                worker.close()
            self.scheduler.close()

    # -- helpers ---------------------------------------------------------------------
    def keys(self, tokens: Sequence[int]) -> list[list[bytes]]:
        """Every full chunk's key per group, computed apart from the scheduler."""
        return prefix_keys_for_layout(tokens, self.config.tokens_per_chunk, self.namespace)

    def ready(self, keys: Sequence[bytes]) -> list[bool]:
        return self.index.ready_mask(keys)

    def alloc(self, n_tokens: int) -> list[list[int]]:
        """Fresh scrubbed blocks for ``n_tokens`` tokens, per group."""
        out = []
        for g, group in enumerate(self.layout.groups):
            n = -(-n_tokens // group.tokens_per_block)
            assert len(self._free[g]) >= n, "the stand ran out of blocks"
            ids = [self._free[g].pop() for _ in range(n)]
            for pages in self.pages:
                for layer in pages.pages[g]:
                    layer[ids] = SCRUB
            out.append(ids)
        return out

    def free(self, req: Req) -> None:
        for g, ids in enumerate(req.blocks):
            self._free[g] += [b for b in ids if b != NULL_BLOCK]
        req.blocks = []

    def write(self, req: Req, start: int, stop: int) -> None:
        """The forward pass: KV of tokens ``[start, stop)`` into every full, non-null block.

        A recurrent group's forward writes one block, the one holding token
        ``stop - 1``: the state after ``stop`` tokens (vLLM's running state).
        """
        for g, group in enumerate(self.layout.groups):
            tpb = group.tokens_per_block
            if group.reuse is Reuse.STATE:
                block = req.blocks[g][(stop - 1) // tpb] if stop > start else NULL_BLOCK
                if block != NULL_BLOCK:
                    for pages in self.pages:
                        pages.write(g, block, state_key(req.hashes[g], req.tokens, stop, tpb))
                continue
            for b in range(start // tpb, min(-(-stop // tpb), len(req.hashes[g]))):
                block = req.blocks[g][b]
                if block != NULL_BLOCK:
                    for pages in self.pages:
                        pages.write(g, block, req.hashes[g][b])

    def load_blocks(self, req: Req) -> dict[int, list[int]]:
        """Per group, the (non-null) blocks a load of ``req``'s hit must fill."""
        out = {}
        for g, group in enumerate(self.layout.groups):
            tpb = group.tokens_per_block
            first = first_token(group, req.local_hit, req.hit) // tpb
            ids = [b for b in req.blocks[g][first : req.hit // tpb] if b != NULL_BLOCK]
            if ids:
                out[g] = ids
        return out

    def block_state(self, req: Req, g: int, b: int, rank: int = 0) -> str:
        """``"exact"``, ``"scrub"`` (never written) or ``"wrong"`` for full block index ``b``."""
        pages, block = self.pages[rank], req.blocks[g][b]
        if pages.holds(g, block, req.hashes[g][b]):
            return "exact"
        if all(bool((layer[block] == SCRUB).all()) for layer in pages.pages[g]):
            return "scrub"
        return "wrong"

    # -- vLLM's calls ----------------------------------------------------------------
    def ask(self, req_id: str, tokens: Sequence[int], local_hit: int = 0) -> Req:
        """``get_num_new_matched_tokens``."""
        offered = self.scheduler.lookup(req_id, tokens, local_hit)
        return Req(req_id, list(tokens), local_hit, offered, block_hashes(self.layout, tokens))

    def allocate(self, req: Req) -> Req:
        """vLLM allocates the request's blocks, then ``update_state_after_alloc``."""
        assert req.offered is not None, "a deferred request is not allocated"
        req.blocks = self.alloc(len(req.tokens))
        if self.null_window:
            for g, group in enumerate(self.layout.groups):
                if group.reuse is Reuse.STATE and req.hit:  # vLLM: [null, ..., null, its block]
                    before = req.hit // group.tokens_per_block - 1
                    self._free[g] += req.blocks[g][:before]
                    req.blocks[g][:before] = [NULL_BLOCK] * before
                if group.sliding_window is not None:
                    before = max(0, req.hit - group.sliding_window + 1) // group.tokens_per_block
                    self._free[g] += req.blocks[g][:before]
                    req.blocks[g][:before] = [NULL_BLOCK] * before
        self.write(req, 0, req.local_hit)  # vLLM's own prefix-cache blocks
        req.load = self.scheduler.plan_load(req.req_id, req.blocks, req.offered)
        req.computed = req.hit
        req.load_ids = self.load_blocks(req)
        if req.load is not None:  # the order covers exactly the blocks the hit needs
            got: dict[int, list[int]] = {}
            for span in req.load.spans:
                got.setdefault(span.group, []).extend(span.blocks.block_ids)
            for g, ids in req.load.unloadable.items():
                got.setdefault(g, []).extend(ids)
            assert {g: sorted(ids) for g, ids in got.items()} == {
                g: sorted(ids) for g, ids in self.load_blocks(req).items()
            }
        return req

    def admit(self, req_id: str, tokens: Sequence[int], local_hit: int = 0) -> Req:
        return self.allocate(self.ask(req_id, tokens, local_hit))

    def step(
        self,
        compute: Sequence[Req] = (),
        *,
        until: int | None = None,
        wait: bool = True,
        held: Sequence[TransferOrder] = (),
        deliver: bool = True,
    ) -> Step:
        """One engine step: plan stores, loads, forward, stores, poll, reports.

        ``compute`` are the requests scheduled to run (up to ``until`` tokens);
        ``held`` orders taken earlier join this step's. ``wait`` waits for
        every job before polling, so the step is deterministic.
        """
        stops, scheduled = {}, []
        for req in compute:
            stop = len(req.tokens) if until is None else min(until, len(req.tokens))
            # vLLM's align mode: a prefill step ends where a state can be kept.
            prompt = req.prompt_len or len(req.tokens)
            stop = aligned_stop(self.layout, req.computed, stop, prompt)
            stops[req.req_id] = stop
            run = stop - req.computed
            scheduled.append(
                StepRequest(req.req_id, req.tokens, req.computed, run, req.blocks, prompt)
            )
        orders = [*held, *self.scheduler.plan_step(scheduled)]
        for worker in self.workers:
            worker.submit(orders, JobKind.LOAD)
        for worker in self.workers:
            worker.before_forward()
        for req in compute:
            self.write(req, req.computed, stops[req.req_id])
            req.computed = stops[req.req_id]
        for worker in self.workers:
            worker.submit(orders, JobKind.STORE)
        out = Step(orders)
        for worker in self.workers:
            if wait:
                assert worker.engine.wait(timeout=60)
            polled = worker.poll()
            out.finished |= polled.finished_recving
            out.failed_recving |= polled.failed_recving
            out.failed_blocks |= worker.take_failed_blocks()
            out.reports.append(worker.take_reports())
        if deliver:
            self.deliver(out)
        return out

    def deliver(self, out: Step) -> None:
        for reports in out.reports:
            for report in reports:
                self.scheduler.on_report(report)

    def check_load(self, req: Req, out: Step) -> None:
        """Loaded blocks are exact; failed ones were never written (never wrong KV)."""
        failed_request = req.req_id in out.failed_recving
        req.verified = 0
        for rank in range(len(self.kv)):
            for g, ids in self.load_blocks(req).items():
                for block in ids:
                    state = self.block_state(req, g, req.blocks[g].index(block), rank)
                    if block in out.failed_blocks and len(self.layout.groups) == 1:
                        assert state == "scrub", (g, block)
                    elif failed_request:
                        assert state in ("exact", "scrub"), (g, block)
                    else:
                        assert state == "exact", (g, block)
                    req.verified += state == "exact" and rank == 0

    def recover(self, req: Req, out: Step) -> None:
        """What vLLM does with a failed load: recompute from the first block that failed."""
        if req.req_id in out.failed_recving:
            req.computed = min(req.computed, req.local_hit)
        elif len(self.layout.groups) == 1:
            bad = [i for i, b in enumerate(req.blocks[0]) if b in out.failed_blocks]
            if bad:
                req.computed = min(req.computed, bad[0] * self.layout.groups[0].tokens_per_block)

    def finish(self, req: Req) -> None:
        self.scheduler.request_finished(req.req_id)
        self.free(req)

    def serve(self, req_id: str, tokens: Sequence[int], local_hit: int = 0) -> tuple[Req, Step]:
        """A whole request: lookup, its load (one step), the rest computed and stored, finished."""
        req = self.admit(req_id, tokens, local_hit)
        out = Step([])
        if req.load is not None:
            out = self.step()
            assert req_id in out.finished
            self.check_load(req, out)
            self.recover(req, out)
        while req.computed < len(req.tokens):
            self.step([req])
        self.finish(req)
        return req, out

    def check_integrity(self) -> None:
        stats = self.index.stats()
        assert (stats.pinned, stats.storing) == (0, 0)
        assert self.scheduler.stats()["jobs_in_flight"] == 0
        self.index.check_integrity()
        for rank, worker in enumerate(self.workers):
            if rank not in self._down:
                worker.engine.cascade.check_integrity()


@pytest.fixture
def stand(tmp_path: Path) -> Iterator[Callable[..., Stand]]:
    """Build stands over ``tmp_path``; all are closed at teardown."""
    made: list[Stand] = []

    def make(model: Model, **kwargs: object) -> Stand:
        made.append(Stand(model, tmp_path, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for s in made:
        s.close()
