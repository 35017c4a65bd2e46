"""vLLM's own ``Request`` objects keyed by the connector: the same chunks change as vLLM's hashes.

No engine runs here: each test builds vLLM 0.32 requests (with vLLM's block
hasher, as an engine with a connector installs it) that differ from a plain
one in one input (a salt, an adapter, an image and its position, prompt
embeddings) and checks, chunk by chunk, that kvoffload's key changes exactly
where vLLM's block hash changes. vLLM's prefix cache is the reference for
what a request's KV depends on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _models import build_lora_adapter

from kvoffload.keys import EngineHashes, extend_engine_keys, prefix_keys

BLOCK = 16
TOKENS = list(range(1, 101))  # 6 full blocks


def vllm_request(**fields: Any) -> Any:
    """A vLLM 0.32 Request with vLLM's block hasher (sha256, blocks of 16)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    fields.setdefault("prompt_token_ids", TOKENS)
    return Request(
        request_id="r",
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **fields,
    )


def image(identifier: str, offset: int, length: int) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )  # fmt: skip


@pytest.fixture(params=["tokens", "engine"])
def source(request: pytest.FixtureRequest) -> str:
    """The connector's ``key_source``: keys hashed from token ids, or chained over vLLM's hashes."""
    return str(request.param)


def keys_of(request: Any, extras: Any, source: str) -> list[bytes]:
    if source == "tokens":
        return prefix_keys(request.all_token_ids, BLOCK, extras=extras)
    engine = EngineHashes(BLOCK, "sha256")
    return extend_engine_keys([], request.block_hashes, BLOCK, engine=engine, extras=extras,
                              stop=len(request.all_token_ids))  # fmt: skip


def changed(request: Any, plain: Any, source: str) -> tuple[list[bool], list[bool]]:
    """Per block: whether vLLM's hash differs from the plain request's, and whether our key does."""
    from kvoffload.vllm._extras import ExtrasReader

    reader = ExtrasReader()
    ours = keys_of(request, reader.read(request), source)
    theirs = request.block_hashes
    plain_ours = keys_of(plain, reader.read(plain), source)
    assert len(ours) == len(theirs) == len(plain.block_hashes) == 6
    return (
        [a != b for a, b in zip(theirs, plain.block_hashes, strict=True)],
        [a != b for a, b in zip(ours, plain_ours, strict=True)],
    )


def embeds(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


CASES = {
    "salt": lambda tmp: {"cache_salt": "tenant-a"},
    "image at 40": lambda tmp: {"mm_features": [image("h1", 40, 20)]},
    "image at 70": lambda tmp: {"mm_features": [image("h1", 70, 20)]},
    "two images": lambda tmp: {"mm_features": [image("h1", 20, 5), image("h2", 60, 8)]},
    "embeds": lambda tmp: {"prompt_token_ids": None, "prompt_embeds": embeds(100)},
}


@pytest.mark.parametrize("case", list(CASES))
def test_keys_change_where_vllms_block_hashes_change(
    case: str, source: str, tmp_path: Path
) -> None:
    plain = vllm_request()
    theirs, ours = changed(vllm_request(**CASES[case](tmp_path)), plain, source)
    assert any(theirs)
    assert ours == theirs


def test_a_lora_adapter_changes_every_chunk_as_in_vllm(
    llama: str, models: Path, source: str
) -> None:
    from vllm.lora.request import LoRARequest

    path = build_lora_adapter(Path(llama), models / "lora_a", seed=1)
    lora = vllm_request(lora_request=LoRARequest("a", 1, str(path)))
    theirs, ours = changed(lora, vllm_request(), source)
    assert ours == theirs == [True] * 6


def test_embedded_rows_key_their_chunks_only_from_the_first_changed_row(source: str) -> None:
    """vLLM hashes each block's embeddings; a changed row changes its block and later ones."""
    rows = embeds(100)
    other = rows.clone()
    other[70] += 1  # block 4 ([64, 80))
    a = vllm_request(prompt_token_ids=None, prompt_embeds=rows)
    theirs, ours = changed(vllm_request(prompt_token_ids=None, prompt_embeds=other), a, source)
    assert theirs == [False, False, False, False, True, True]
    assert ours == theirs
