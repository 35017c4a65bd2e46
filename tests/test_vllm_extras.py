"""A LoRA adapter is keyed by the files vLLM loads it from, read from real directories.

(How the rest of a vLLM request becomes ``KeyExtras`` is checked on vLLM's
own ``Request`` objects in ``tests_e2e/test_request_keys.py``.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvoffload.vllm._extras import ADAPTER_CONFIG, Unkeyable, adapter_digest


def adapter(
    path: Path, weights: bytes = b"weights-1", name: str = "adapter_model.safetensors"
) -> Path:
    path.mkdir(parents=True)
    (path / ADAPTER_CONFIG).write_text('{"r": 8, "lora_alpha": 16}')
    (path / name).write_bytes(weights * 1000)
    return path


def test_the_digest_names_the_weights_not_the_directory(tmp_path: Path) -> None:
    a = adapter(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "a-copy"
    shutil.copytree(a, copy)
    (copy / "README.md").write_text("not read by vLLM, not in the key")
    assert adapter_digest(str(a)) == adapter_digest(str(copy))
    assert len(adapter_digest(str(a))) == 16


def test_other_weights_config_or_format_give_another_digest(tmp_path: Path) -> None:
    base = adapter_digest(str(adapter(tmp_path / "a")))
    retrained = adapter(tmp_path / "b", weights=b"weights-2")
    assert adapter_digest(str(retrained)) != base
    other_config = adapter(tmp_path / "c")
    (other_config / ADAPTER_CONFIG).write_text('{"r": 8, "lora_alpha": 32}')
    assert adapter_digest(str(other_config)) != base
    as_bin = adapter(tmp_path / "d", name="adapter_model.bin")
    assert adapter_digest(str(as_bin)) != base


def test_what_cannot_be_read_is_unkeyable_by_name(tmp_path: Path) -> None:
    with pytest.raises(Unkeyable, match="'org/some-adapter' is not a directory"):
        adapter_digest("org/some-adapter")  # a hub id: vLLM downloads it on the worker
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ADAPTER_CONFIG).write_text("{}")
    with pytest.raises(Unkeyable, match=r"holds no adapter_config\.json and adapter_model"):
        adapter_digest(str(empty))
