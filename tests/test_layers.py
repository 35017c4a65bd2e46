"""The layering of DESIGN.md, checked: layers import downward only, the vLLM adapter is thin,
modules and functions stay small, and the scheduler side runs where torch cannot be imported."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import kvoffload

_BLOCK_TORCH = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is not importable in this process")
            return None

    sys.meta_path.insert(0, NoTorch())
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_blocker_does_block_torch() -> None:
    done = run_without_torch("import torch")
    assert done.returncode != 0 and "torch is not importable" in done.stderr


def test_the_scheduler_side_and_its_messages_import_without_torch() -> None:
    done = run_without_torch(
        """
        import sys
        import kvoffload
        from kvoffload.messages import BlockSpan, ChunkSpan, JobReport, TransferOrder
        from kvoffload.connector.scheduler import OffloadScheduler
        from kvoffload.tiers.from_config import rank_probes
        from kvoffload.cli import plan
        assert kvoffload.ChunkSpan is ChunkSpan
        assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# -- the shape of the package: layers as folders, small modules ---------------------------

PACKAGE = Path(kvoffload.__file__).parent

#: DESIGN.md's layers, top first: a module may import its own layer and the ones below.
LAYER_RANKS = {
    "cli": 9, "replay": 8, "bench": 8, "vllm": 7, "standin": 6, "connector": 5, "engine": 4,
    "manager": 3.5, "tiers": 3.2, "transfer": 3, "keys": 2, "messages": 2, "config": 1,
    "registry": 1, "errors": 0, "_checks": 0, "_records": 0, "__init__": 10, "__main__": 10,
}  # fmt: skip
#: Modules of the vLLM adapter that speak vLLM without importing it (so that their logic is
#: unit-tested without vLLM installed), and what of vLLM they speak.
SPEAKS_VLLM = {
    "_extras": "reads vLLM's request (cache salt, LoRA request, multimodal features)",
    "_key_source": "knows which of vLLM's hash algorithms are seeded per process",
    "_metrics": "shapes vLLM's KVConnectorStats payload and its vllm:kvoffload_* series",
    "_startup": "reads vLLM's engine configuration (VllmConfig) at start",
    "_versions": "names the vLLM releases the adapter is checked against",
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def imported(tree: ast.Module) -> list[str]:
    """Every module ``tree`` imports, at the top or inside a function."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_no_module_or_function_outgrows_the_size_rule() -> None:
    """STYLE.md's shape: modules under ~400 lines, functions under ~60 (docstrings count)."""
    too_big = []
    for path, tree in modules():
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            too_big.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_big.append(
                        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length}"
                    )
    assert not too_big, (
        f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function "
        "(split by concept): " + "; ".join(too_big)
    )


def test_every_layer_imports_only_itself_and_the_layers_below() -> None:
    upward = []
    for path, tree in modules():
        mine = path.relative_to(PACKAGE).with_suffix("").parts[0]
        assert mine in LAYER_RANKS, f"{mine}: place this new package in LAYER_RANKS (DESIGN.md)"
        for name in imported(tree):
            parts = name.split(".")
            if parts[0] != "kvoffload" or len(parts) < 2 or parts[1] == mine:
                continue
            if LAYER_RANKS.get(parts[1], 99) > LAYER_RANKS[mine]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not upward, "imports that run up the layers: " + "; ".join(upward)


def test_the_vllm_adapter_holds_only_what_speaks_vllm() -> None:
    """Engine-neutral logic lives in the connector core; kvoffload/vllm/ is the thin adapter."""
    neutral = []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] != "vllm" or rel.stem == "__init__" or rel.stem in SPEAKS_VLLM:
            continue
        if not any(name == "vllm" or name.startswith("vllm.") for name in imported(tree)):
            neutral.append(str(rel))
    assert not neutral, f"modules under kvoffload/vllm/ that never touch vLLM: {neutral}"
    present = {p.stem for p in (PACKAGE / "vllm").glob("*.py")}
    assert present >= SPEAKS_VLLM.keys(), "SPEAKS_VLLM names a module that is gone"
