"""Unpack vLLM 0.33's Python modules into a directory, for ``make vllm033-check``.

Usage: ``python tests_e2e/_vllm033.py DIR``. Downloads the wheel from PyPI
(``pip download vllm==0.33.0 --no-deps``, about 340 MB) and extracts every
file but the compiled extensions: the connector API, the KV cache specs and
vLLM's grouping code import without them, in front of the 0.32 environment.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.33.0"


def unpack(target: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             f"vllm=={VERSION}", "-d", scratch],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(scratch).glob(f"vllm-{VERSION}-*.whl")
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if not (n.endswith(".so") or ".so." in n)]
            archive.extractall(partial, members=names)
        partial.rename(target)


if __name__ == "__main__":
    unpack(Path(sys.argv[1]))
