"""The Triton kernel path against the torch paths: every layout, dtype and block order, bit-exact.

On host tensors the kernel runs in Triton's interpreter (what ``TRITON_INTERPRET=1``
selects), so these tests check it on machines without a GPU; on a GPU the
``cuda-kernel`` path of ``tests/_paths.py`` runs every round trip of the other
transfer tests through it. The references: the direct path's chunk bytes for a
gather, the staged path's engine tensors (padding and other groups included) for a
scatter. The interpreter is slow: tensors here are a few KiB.

Triton is in the dev extra. Without it these tests skip, except where
``KVOFFLOAD_REQUIRE_TRITON`` is set (``.ci/run`` sets it): there a missing Triton fails.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_transfer_packed import GEOMETRIES, layout_of, vllm_views

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.engine import ChunkSpan, JobStatus, OffloadEngine
from kvoffload.errors import TransferError
from kvoffload.messages import BlockSpan
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.transfer import KernelUse, KVTransfer, allocate_kv_caches, fill_blocks
from kvoffload.transfer._calibrate import PathChoice, calibrate
from kvoffload.transfer.synthetic import EngineLayout

if os.environ.get("KVOFFLOAD_REQUIRE_TRITON"):
    import triton  # noqa: F401 - CI: a missing Triton is a failure, not a skip
else:
    pytest.importorskip("triton", reason="the kernel path needs Triton (pip install triton)")

NUM_BLOCKS = 24
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]
Caches = dict[str, torch.Tensor]
Make = Callable[[int], Caches]  # seed -> fresh engine tensors filled from it
Buffers = Callable[[int, int], list[torch.Tensor]]  # (chunks, chunk bytes) -> buffers


def hybrid() -> KVLayout:
    """A window group, a full group, and a state group whose pages the engine pads."""
    return KVLayout(
        (
            CacheGroup("sliding", 8, ("s0", "s1"), 256, sliding_window=16),
            CacheGroup("full", 2, ("f0",), 2 * 2 * 4 * 8),
            CacheGroup("mamba", 8, ("m0", "m1"), 72),
        )
    )


def synthetic(layout: KVLayout, dtype: torch.dtype, engine_layout: EngineLayout) -> Make:
    def make(seed: int) -> Caches:
        caches = allocate_kv_caches(layout, NUM_BLOCKS, dtype, engine_layout)
        fill_blocks(caches, seed=seed)
        return caches

    return make


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage: padding, other layers and groups included."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def zeroed(n: int, size: int) -> list[torch.Tensor]:
    return [torch.zeros(size + 3, dtype=torch.uint8) for _ in range(n)]  # +3: no write past


def check_group(  # noqa: PLR0917 - test helper, called positionally
    layout: KVLayout,
    make: Make,
    group: int,
    span: BlockSpan,
    bpc: int,
    buffers: Buffers = zeroed,
) -> None:
    src = make(1)
    kernel = KVTransfer(layout, src, bpc, kernel="always")
    if kernel.chunk_blocks(group) == 1:
        span = BlockSpan(span.block_ids)  # a state chunk is one block: no offset inside it
    n, size = span.num_chunks(kernel.chunk_blocks(group)), kernel.chunk_bytes(group)
    got, want = buffers(n, size), zeroed(n, size)
    kernel.gather(group, span, got)
    KVTransfer(layout, src, bpc).gather(group, span, want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[:size], b[:size]), f"group {group}: chunk bytes differ"
        assert not a[size:].any(), f"group {group}: wrote past the chunk"
    by_kernel, by_staged = make(2), make(2)
    KVTransfer(layout, by_kernel, bpc, kernel="always").scatter(group, span, want)
    KVTransfer(layout, by_staged, bpc, staged=True).scatter(group, span, want)
    for name, t in by_kernel.items():
        assert torch.equal(storage_bytes(t), storage_bytes(by_staged[name])), (group, name)


# Unsorted, not adjacent, starting inside its first chunk and ending inside its last.
SHUFFLED = BlockSpan((5, 6, 7, 20, 2, 3, 11), first_offset=1)


@pytest.mark.parametrize("engine_layout", list(EngineLayout))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_layout_and_dtype_matches_the_torch_paths(
    engine_layout: EngineLayout, dtype: torch.dtype
) -> None:
    layout = hybrid()
    for group in range(len(layout.groups)):
        check_group(layout, synthetic(layout, dtype, engine_layout), group, SHUFFLED, 3)


@pytest.mark.parametrize(
    "span",
    [
        BlockSpan(tuple(range(8, 16))),  # consecutive, whole chunks
        BlockSpan(tuple(range(23, 11, -1)), first_offset=3),  # descending
        BlockSpan((17,), first_offset=2),  # one block inside a chunk
        BlockSpan((0, 23, 1, 22, 2, 21, 3, 20, 9)),  # from both ends of the tensor
    ],
    ids=["consecutive", "descending", "one-block", "both-ends"],
)
@pytest.mark.parametrize("engine_layout", [EngineLayout.KV_FIRST, EngineLayout.BLOCK_FIRST])
def test_block_orders(span: BlockSpan, engine_layout: EngineLayout) -> None:
    layout = hybrid()
    make = synthetic(layout, torch.bfloat16, engine_layout)
    for group in range(len(layout.groups)):
        check_group(layout, make, group, span, 4)


@pytest.mark.parametrize("slots", [(4, 5, 0), (5, 1, 3)], ids=["wrapping", "apart"])
def test_slab_slots_that_wrap_or_lie_apart(slots: tuple[int, ...]) -> None:
    """Chunk buffers are slab slots: past the end and back to the first, or out of order."""
    layout = hybrid()
    slab = CPUSlab(6, max(g.chunk_bytes(2) for g in layout.groups), pin_memory=False)

    def slab_slots(n: int, size: int) -> list[torch.Tensor]:
        slab.slab.zero_()
        return [slab.slot(s, size) for s in slots[:n]]

    make = synthetic(layout, torch.float16, EngineLayout.KV_FIRST)
    for group in range(len(layout.groups)):
        span = BlockSpan((3, 9, 4, 5, 1, 14), first_offset=0)
        span = span if group < 2 else BlockSpan((3, 9, 4))
        check_group(layout, make, group, span, 2, slab_slots)


@pytest.mark.parametrize(("geometry", "bpc"), [("fp8_ds_mla", 2)])  # the interpreter is slow
def test_deepseek_v4_packed_groups(geometry: str, bpc: int) -> None:
    """Mixed page sizes in a group, padded pages, fp8 bytes beside fp32 (test_transfer_packed)."""
    block_stride, groups = GEOMETRIES[geometry]()
    layout = layout_of(groups)
    blocks = 12

    def make(seed: int) -> Caches:
        gen = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (blocks * block_stride,), dtype=torch.uint8, generator=gen)
        return vllm_views(block_stride, groups, raw.view(torch.int8))

    span = BlockSpan((9, 2, 5, 6), first_offset=1) if bpc == 2 else BlockSpan((9, 2, 5))
    for group in range(len(layout.groups)):
        check_group(layout, make, group, span, bpc)


def test_pages_and_buffers_that_are_not_whole_words() -> None:
    """6-byte K and V halves and chunk buffers at odd addresses: the kernel moves bytes."""
    layout = KVLayout((CacheGroup("full", 2, ("a", "b"), 2 * 2 * 3),))
    backing = torch.zeros(1024, dtype=torch.uint8)

    def odd(n: int, size: int) -> list[torch.Tensor]:
        return [backing[1 + i * (size + 5) : 1 + i * (size + 5) + size] for i in range(n)]

    for engine_layout in (EngineLayout.KV_FIRST, EngineLayout.BLOCK_FIRST):
        make = synthetic(layout, torch.uint8, engine_layout)
        check_group(layout, make, 0, BlockSpan((3, 9, 4, 5, 1)), 2)
        check_group(layout, make, 0, BlockSpan((3, 9, 4, 5, 1)), 2, odd)


def test_engine_jobs_on_the_kernel_path() -> None:
    """The worker's engine (two threads) stores and loads through the kernel, bit-exact."""
    layout = hybrid()
    make = synthetic(layout, torch.bfloat16, EngineLayout.KV_FIRST)
    kv, original = make(5), make(5)
    transfer = KVTransfer(layout, kv, 2, kernel=KernelUse.ALWAYS)
    slab = CPUSlab(8, max(g.chunk_bytes(2) for g in layout.groups), pin_memory=False)
    engine = OffloadEngine.create(transfer, slab, max_workers=2)
    spans = [
        ChunkSpan(0, (b"s-a", b"s-b"), (0, 1), BlockSpan((4, 5, 9, 2))),
        ChunkSpan(1, (b"f-a",), (2,), BlockSpan((7, 3))),
        ChunkSpan(2, (b"m-a", b"m-b"), (3, 4), BlockSpan((6, 8))),
    ]
    try:
        for submit in (engine.submit_store, engine.submit_load):
            submit(spans)
            assert engine.wait(timeout=60)
            assert all(r.status is JobStatus.SUCCESS for r in engine.get_finished())
            if submit == engine.submit_store:  # the load must bring every byte back
                for t in kv.values():
                    storage_bytes(t).zero_()
    finally:
        engine.close()
    reference = KVTransfer(layout, original, 2)
    for span in spans:
        n, size = span.blocks.num_chunks(transfer.chunk_blocks(span.group)), 4096
        got, want = zeroed(n, size), zeroed(n, size)
        KVTransfer(layout, kv, 2).gather(span.group, span.blocks, got)
        reference.gather(span.group, span.blocks, want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), span.group


def test_kernel_use_is_named_or_refused() -> None:
    layout = hybrid()
    kv = synthetic(layout, torch.bfloat16, EngineLayout.BLOCK_FIRST)(0)
    assert KVTransfer(layout, kv, 2).kernel is KernelUse.OFF  # the default until a GPU run
    assert KVTransfer(layout, kv, 2, kernel="auto").kernel is KernelUse.AUTO
    with pytest.raises(TransferError, match=r"'off', 'always', 'auto'.*'fast'"):
        KVTransfer(layout, kv, 2, kernel="fast")


def test_without_triton_always_is_refused_and_auto_keeps_the_torch_path_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "kvoffload.transfer._triton", None)  # as if not installed
    layout = hybrid()
    make = synthetic(layout, torch.float32, EngineLayout.KV_FIRST)
    with pytest.raises(TransferError, match=r"needs Triton.*pip install triton.*kernel='off'"):
        KVTransfer(layout, make(0), 2, kernel="always")
    auto = KVTransfer(layout, make(0), 2, kernel="auto")  # host tensors: no Triton needed
    span = BlockSpan((5, 6, 7, 20), first_offset=1)
    got, want = zeroed(3, auto.chunk_bytes(0)), zeroed(3, auto.chunk_bytes(0))
    auto.gather(0, span, got)
    KVTransfer(layout, make(0), 2).gather(0, span, want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_calibration_times_both_paths_on_scratch_and_leaves_the_engine_alone() -> None:
    layout = hybrid()
    kv = synthetic(layout, torch.bfloat16, EngineLayout.KV_FIRST)(3)
    before = {n: storage_bytes(t).clone() for n, t in kv.items()}
    transfer = KVTransfer(layout, kv, 2)
    groups = range(len(layout.groups))
    choice = calibrate(transfer.groups, [transfer.chunk_blocks(g) for g in groups],
                       [transfer.chunk_bytes(g) for g in groups], call_chunks=(1, 2))  # fmt: skip
    assert choice.call_chunks == (1, 2)
    assert [[len(rows) for rows in directions] for directions in choice.seconds] == [[2, 2]] * 3
    seconds = [s for d in choice.seconds for rows in d for pair in rows for s in pair]
    assert all(0 < s < math.inf for s in seconds)
    assert all(torch.equal(storage_bytes(t), before[n]) for n, t in kv.items())


def test_path_choice_uses_the_largest_measured_call_size_not_above_the_call() -> None:
    # group 0: load (dma, kernel) per size 1, 8, 64; then store.
    load = ((1.0, 2.0), (1.0, 0.5), (1.0, 3.0))
    store = ((2.0, 1.0), (2.0, 1.0), (1.0, 2.0))
    choice = PathChoice((1, 8, 64), ((load, store),))
    assert [choice.use_kernel(0, False, n) for n in (1, 7, 8, 63, 64, 500)] == [
        False, False, True, True, False, False,
    ]  # fmt: skip
    assert [choice.use_kernel(0, True, n) for n in (1, 8, 64)] == [True, True, False]
    summary = choice.summary()
    assert "group 0: load x1: dma (0.50x), load x8: kernel (2.00x)" in summary
    assert "store x64: dma (0.50x)" in summary


@pytest.mark.parametrize(
    ("word", "aligned16", "ops"),
    [(8, True, {"ld.global.v2.b64", "st.global.v2.b64"}), (1, False, {"st.global.b8"})],
)
def test_kernel_compiles_for_a_gpu_without_one(word: int, aligned16: bool, ops: set[str]) -> None:
    """The interpreter accepts more than the compiler: compile for sm_90 (Triton's own ptxas).

    Aligned pages must become 16-byte loads and stores, sub-word ones byte copies.
    """
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvoffload.transfer import _triton

    constants = {"WORD": _triton._WORDS[word], "WORD_BYTES": word, "TILE": 2048 // word,
                 "TO_CHUNKS": True, "ALIGNED16": aligned16}  # fmt: skip
    signature = {"pieces": "*i64", "blocks": "*i64", "n_blocks": "i32"}
    source = ASTSource(fn=_triton._compiled, signature={**signature, **dict.fromkeys(constants,
                       "constexpr")}, constexprs=constants)  # fmt: skip
    kernel = triton_compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"enable_fp_fusion": False})  # fmt: skip
    assert "cubin" in kernel.asm
    assert ops <= {w for line in kernel.asm["ptx"].splitlines() for w in line.split()}


def test_gpu_check_dry_runs_the_kernel_paths_and_the_planned_models(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py's kernel and engine-kernel rows, and its model rows."""
    out = tmp_path / "rows.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    args = ["--device", "cpu", "--chunk-mib", "0.0625", "--layouts", "kv_first", "--layers", "2",
            "--total-mib", "0.125", "--chunks-per-job", "2", "--repeat", "1", "--model-bpc", "1",
            "--paths", "kernel,engine-kernel", "--models", "tiny_gemma4:bfloat16",
            "--json-out", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text(encoding="utf-8"))["rows"]
    assert [(r["layout"], r["path"]) for r in rows] == [
        (layout, path)
        for layout in ("kv_first", "tiny_gemma4:bfloat16")
        for _ in ("consecutive", "shuffled")
        for path in ("kernel", "engine-kernel")
    ]
    assert all(r["bit_exact"] and r["d2h_gbps"] > 0 for r in rows)


def test_calibration_stops_at_the_scratch_bound_and_larger_calls_keep_its_last_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvoffload.transfer import _calibrate

    monkeypatch.setattr(_calibrate, "MAX_SCRATCH_BYTES", 1)  # only the first size fits
    layout = hybrid()
    transfer = KVTransfer(layout, synthetic(layout, torch.float16, EngineLayout.BLOCK_FIRST)(0), 2)
    groups = range(len(layout.groups))
    choice = calibrate(transfer.groups, [transfer.chunk_blocks(g) for g in groups],
                       [transfer.chunk_bytes(g) for g in groups], call_chunks=(1, 8))  # fmt: skip
    assert [[len(rows) for rows in directions] for directions in choice.seconds] == [[1, 1]] * 3
    (dma, kernel), *_ = choice.seconds[0][1]
    assert choice.use_kernel(0, True, 64) is (kernel < dma)
