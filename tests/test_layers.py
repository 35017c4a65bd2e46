"""The layering of DESIGN.md, checked: the scheduler side runs where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
