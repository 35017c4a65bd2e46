"""The records between the stand-in engine and a connector plugged into it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from kvoffload.keys import KeyExtras

__all__ = [
    "ConnectorSide",
    "SimRequest",
    "StandInStats",
    "Status",
    "StepPlan",
    "Stopwatch",
    "WorkerResult",
]


class Status(Enum):
    WAITING = "waiting"
    LOADING = "loading"  # vLLM's WAITING_FOR_REMOTE_KVS
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request: its tokens, the engine's block hashes and blocks per group, progress."""

    req_id: str
    tokens: Sequence[int]
    #: Per group, the hash of each full block (every token up to its end, and the layout's
    #: lookahead after it: a block without those tokens has none): what its final KV is of.
    hashes: list[list[bytes]]
    blocks: list[list[int]]
    #: What its KV depends on besides its tokens (salt, LoRA adapter, ...), keyed with them.
    extras: KeyExtras | None = None
    status: Status = Status.WAITING
    computed: int = 0
    #: Tokens the GPU prefix cache served, and those the connector offered and vLLM took.
    local_hit: int = 0
    external: int = 0
    #: Per group, how many of ``blocks`` the connector has been told of (vLLM's new_block_ids).
    told: list[int] = field(default_factory=list)
    #: Tokens of its prompt (0: all of ``tokens``); the rest is the output it generates.
    num_prompt: int = 0
    #: vLLM's ``request.block_hashes``: one per ``StandIn.hash_block_size`` tokens.
    block_hashes: list[bytes] = field(default_factory=list)
    #: Tokens whose KV is final (with a lookahead, behind ``computed``: ``standin._forward``).
    final: int = 0
    #: With a lookahead and KV pages, per group, each full block's hash without it: what the
    #: block holds until its KV is final.
    provisional: list[list[bytes]] = field(default_factory=list)
    #: The client's ``kv_transfer_params`` (a retention hint), read once by the connector.
    kv_transfer_params: Mapping[str, object] | None = None
    hint_read: bool = False

    def __post_init__(self) -> None:
        self.num_prompt = self.num_prompt or len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prompt(self) -> Sequence[int]:
        tokens = self.tokens
        return tokens if self.num_prompt == len(tokens) else tokens[: self.num_prompt]

    @property
    def last(self) -> int:
        """Tokens computed when it finishes: vLLM never computes the last token it samples,
        so a prompt alone (one token sampled, not kept) is computed whole."""
        return max(self.num_prompt, self.num_tokens - 1)


@dataclass(slots=True)
class StepPlan:
    """vLLM's ``SchedulerOutput`` as far as a connector reads it."""

    #: Requests running this step and the tokens each computes, in scheduling order.
    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    #: Ids scheduled for the first time (``scheduled_new_reqs``); the others are cached.
    first: set[str] = field(default_factory=set)
    #: Ids whose load the step runs before its forward pass (``loads_in_step``).
    in_step: set[str] = field(default_factory=set)
    #: Per scheduled request, the blocks allocated since it was last scheduled.
    new_blocks: dict[str, list[list[int]]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(slots=True)
class WorkerResult:
    """What the worker side hands back after a step (vLLM's ``KVConnectorOutput``)."""

    finished_recving: set[str]
    failed_recving: set[str]
    #: Engine block ids whose load failed (single-group layouts).
    failed_blocks: set[int]
    #: The side's own report to its scheduler side (worker metadata).
    payload: object = None


class Stopwatch:
    """Seconds spent inside ``with`` blocks: a side's scheduler-side time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start


class ConnectorSide(Protocol):
    """A connector as vLLM's scheduler and model runner call it (see the module docstring)."""

    clock: Stopwatch

    def add_request(self, req: SimRequest) -> None: ...
    def get_num_new_matched_tokens(self, req: SimRequest, num_computed: int) -> int | None: ...
    def loads_in_step(self, req: SimRequest) -> bool: ...
    def update_state_after_alloc(self, req: SimRequest, num_external: int) -> None: ...
    def build_connector_meta(self, plan: StepPlan) -> object: ...
    def run_worker(self, meta: object, forward: Callable[[], None]) -> WorkerResult: ...
    def update_connector_output(self, result: WorkerResult) -> None: ...
    def request_finished(self, req: SimRequest) -> None: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class StandInStats:
    """Counters of one run, in tokens unless named otherwise."""

    requests: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    #: Offered by the connector and taken, loaded successfully, lost to failed loads.
    external_tokens: int = 0
    loaded_tokens: int = 0
    failed_load_tokens: int = 0
    deferred_lookups: int = 0
    gpu_evictions: int = 0
    #: With KV pages: loaded blocks checked and found exact; any block found wrong.
    verified_blocks: int = 0
    mismatched_blocks: int = 0
    scheduler_seconds: float = 0.0
    seconds: float = 0.0
