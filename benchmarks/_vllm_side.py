"""vLLM 0.32's own ``OffloadingConnector`` (scheduler role) as a stand-in connector side.

The connector is vLLM's, built the way vLLM builds it (a ``VllmConfig`` with a
``KVTransferConfig`` naming ``OffloadingConnector``, the model's
``KVCacheConfig``), with ``CPUOffloadingSpec`` and its ``CPUOffloadingManager``.
Every call the stand-in makes becomes the call vLLM's scheduler makes, with
vLLM's own objects (``Request``, ``KVCacheBlocks``, ``SchedulerOutput``,
``KVConnectorOutput``); building those objects is the engine's work and is
not timed, only the connector's calls are.

Its worker side refuses the CPU platform, so there is none: every transfer
job completes in the step that issued it, as kvoffload's do in a settled
stand-in step (those move real bytes; these move none, which only flatters
vLLM's side). Import this module only where vLLM is installed.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.keys import prefix_keys
from kvoffload.standin import SimRequest, StepPlan, Stopwatch, WorkerResult

__all__ = ["VLLMSide"]

#: A model config vLLM can parse; only its KV dtype and the connector's geometry matter here.
_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
    "num_hidden_layers": 1, "vocab_size": 1024, "max_position_embeddings": 1 << 20,
    "torch_dtype": "float16", "head_dim": 32,
}  # fmt: skip


def _spec(group: CacheGroup) -> FullAttentionSpec:
    """vLLM's spec of one group: its kind, block size and window (pages are one fp16 head)."""
    if group.kind == "sliding":
        assert group.sliding_window is not None
        return SlidingWindowSpec(  # type: ignore[return-value]
            block_size=group.tokens_per_block, num_kv_heads=1, head_size=1,
            dtype=torch.float16, sliding_window=group.sliding_window,
        )  # fmt: skip
    return FullAttentionSpec(
        block_size=group.tokens_per_block, num_kv_heads=1, head_size=1, dtype=torch.float16
    )


def _kv_cache_config(layout: KVLayout, gpu_blocks: int) -> KVCacheConfig:
    specs = [_spec(g) for g in layout.groups]
    page = max(spec.page_size_bytes for spec in specs)
    tensors = [
        KVCacheTensor(size=page * gpu_blocks, layers=list(g.layer_names),
                      layer_stride=page * gpu_blocks, block_stride=page)
        for g in layout.groups
    ]  # fmt: skip
    pairs = zip(layout.groups, specs, strict=True)
    groups = [KVCacheGroupSpec(list(g.layer_names), s) for g, s in pairs]
    return KVCacheConfig(num_blocks=gpu_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


class VLLMSide:
    """vLLM's ``OffloadingConnector`` with ``capacity`` CPU chunks and its ``policy``."""

    def __init__(self, layout: KVLayout, capacity: int, policy: str, gpu_blocks: int) -> None:
        self.layout = layout
        self._model_dir = tempfile.TemporaryDirectory(prefix="kvoffload-vllm-side-")
        Path(self._model_dir.name, "config.json").write_text(json.dumps(_MODEL))
        model = ModelConfig(model=self._model_dir.name, skip_tokenizer_init=True,
                            dtype="float16", max_model_len=1 << 20)  # fmt: skip
        kv_config = _kv_cache_config(layout, gpu_blocks)
        per_block = kv_config.kv_cache_tensors[0].size // gpu_blocks  # vLLM's own reckoning
        align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
        extra = {"cpu_bytes_to_use": capacity * (-(-per_block // align) * align),
                 "blocks_per_chunk": 1, "eviction_policy": policy}  # fmt: skip
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                    kv_connector_extra_config=extra)  # fmt: skip
        cache = CacheConfig(block_size=min(layout.tokens_per_block), enable_prefix_caching=True)
        vllm_config = VllmConfig(model_config=model, kv_transfer_config=transfer,
                                 cache_config=cache)  # fmt: skip
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_config)
        manager: Any = self.connector.scheduler.manager
        if manager._num_chunks != capacity:
            raise RuntimeError(
                f"vLLM's CPU tier holds {manager._num_chunks} chunks, not {capacity}"
            )
        self.tokens_per_hash = self.connector.scheduler.config.tokens_per_hash
        self.clock = Stopwatch()
        self._requests: dict[str, Request] = {}

    # -- scheduler side -------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        if self.tokens_per_hash == self.layout.groups[0].tokens_per_block:
            hashes = list(req.hashes[0])
        else:
            hashes = prefix_keys(req.tokens, self.tokens_per_hash, 0, b"vllm block hashes")
        request = Request(req.req_id, list(req.tokens), SamplingParams(max_tokens=1), None,
                          block_hasher=_once(hashes))  # fmt: skip
        self._requests[req.req_id] = request
        with self.clock:
            self.connector.on_new_request(request)

    def get_num_new_matched_tokens(self, req: SimRequest, num_computed: int) -> int | None:
        request = self._requests[req.req_id]
        request.num_computed_tokens = 0
        with self.clock:
            tokens, _ = self.connector.get_num_new_matched_tokens(request, num_computed)
        return tokens

    def loads_in_step(self, req: SimRequest) -> bool:
        return False  # vLLM's offloading loads every hit asynchronously

    def update_state_after_alloc(self, req: SimRequest, num_external: int) -> None:
        blocks = KVCacheBlocks(tuple(
            [KVCacheBlock(b, is_null=b == 0,
                          _block_hash=b"cached" if (i + 1) * tpb <= req.local_hit else None)  # type: ignore[arg-type]
             for i, b in enumerate(ids)]
            for ids, tpb in zip(req.blocks, self.layout.tokens_per_block, strict=True)
        ))  # fmt: skip
        with self.clock:
            self.connector.update_state_after_alloc(
                self._requests[req.req_id], blocks, num_external
            )

    def build_connector_meta(self, plan: StepPlan) -> object:
        new, cached = [], []
        for req, _ in plan.scheduled:
            request = self._requests[req.req_id]
            request.num_computed_tokens = req.computed
            request.status = RequestStatus.RUNNING
            (new if req.req_id in plan.first else cached).append(req)
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(r.req_id, None, [], None, None, tuple(list(ids) for ids in r.blocks),
                               r.computed, None)
                for r in new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.req_id for r in cached], resumed_req_ids=set(), new_token_ids=[],
                all_token_ids={}, new_block_ids=[tuple(plan.new_blocks[r.req_id]) for r in cached],
                num_computed_tokens=[r.computed for r in cached],
                num_output_tokens=[0] * len(cached),
            ),
            num_scheduled_tokens={req.req_id: n for req, n in plan.scheduled},
            total_num_scheduled_tokens=plan.num_tokens, scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={}, finished_req_ids=set(plan.finished),
            free_encoder_mm_hashes=[], preempted_req_ids=set(),
        )  # fmt: skip
        with self.clock:
            meta = self.connector.build_connector_meta(output)
        for req_id in plan.finished:
            self._requests.pop(req_id, None)
        return meta

    def update_connector_output(self, result: WorkerResult) -> None:
        output = KVConnectorOutput(
            finished_recving=result.finished_recving, kv_connector_worker_meta=result.payload
        )  # type: ignore[arg-type]
        with self.clock:
            self.connector.update_connector_output(output)

    def request_finished(self, req: SimRequest) -> None:
        request = self._requests[req.req_id]
        request.num_computed_tokens = req.computed
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        block_ids = tuple(list(ids) for ids in req.blocks)
        with self.clock:
            self.connector.request_finished_all_groups(request, block_ids)

    # -- worker side: none runs on the CPU; every job completes at once ---------------------
    def run_worker(self, meta: object, forward: Callable[[], None]) -> WorkerResult:
        assert isinstance(meta, OffloadingConnectorMetadata)
        forward()
        done = OffloadingWorkerMetadata()
        for job_id in [*meta.load_jobs, *meta.store_jobs]:
            done.mark_completed(job_id)
        loaded = {job.req_id for job in meta.load_jobs.values()}
        return WorkerResult(loaded, set(), set(), done)

    def close(self) -> None:
        self.connector.shutdown()
        self._model_dir.cleanup()


def _once(hashes: Sequence[bytes]) -> Callable[[Request], list[Any]]:
    """vLLM's block hasher for a request whose hashes are known: the new ones, once."""

    def hasher(request: Request) -> list[Any]:
        return list(hashes[len(request.block_hashes) :])

    return hasher
