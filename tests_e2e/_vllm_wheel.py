"""Unpack a vLLM release's Python modules into a directory, for ``make vllm-api-check``.

Usage: ``python tests_e2e/_vllm_wheel.py VERSION DIR`` (``0.33.0``, ``0.34.0``).
Downloads the wheel from PyPI (``pip download vllm==VERSION --no-deps``, about
340 MB) and extracts every file but the compiled extensions: the connector API,
the KV cache specs and vLLM's grouping code import without them, in front of
the 0.32 environment. Those releases pin a newer torch than vLLM's CPU build,
so they cannot be installed beside it.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def unpack(version: str, target: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             f"vllm=={version}", "-d", scratch],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(scratch).glob(f"vllm-{version}-*.whl")
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if not (n.endswith(".so") or ".so." in n)]
            archive.extractall(partial, members=names)
        partial.rename(target)


if __name__ == "__main__":
    unpack(sys.argv[1], Path(sys.argv[2]))
